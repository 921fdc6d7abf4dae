"""Stop requests from signals: SIGINT, SIGTERM and SIGHUP (a closed terminal or a dropped ssh) all ask the loop to
finish the current step, save a checkpoint and exit 0."""

from __future__ import annotations

import signal

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_WHY = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "a kill / scheduler request",
        signal.SIGHUP: "the terminal or ssh session closed"}


class SignalFlag:
    """Records the first stop signal. A second SIGINT/SIGTERM stops at once (KeyboardInterrupt); SIGHUP never
    escalates, since a hang-up arrives twice (from the kernel and from the shell). A signal already ignored when
    training starts (SIGHUP under `nohup`) stays ignored."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict = {}

    def __enter__(self) -> SignalFlag:
        for sig in STOP_SIGNALS:
            if signal.getsignal(sig) is signal.SIG_IGN:
                continue
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, _frame) -> None:
        if self.signum is not None:
            if signum == signal.SIGHUP:
                return
            raise KeyboardInterrupt
        self.signum = signum

    @property
    def reason(self) -> str:
        """E.g. `SIGHUP (the terminal or ssh session closed)`."""
        if self.signum is None:
            return "none"
        sig = signal.Signals(self.signum)
        return f"{sig.name} ({_WHY.get(sig, 'signal')})"

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
