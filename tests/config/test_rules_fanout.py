"""`rollout.server.weight_fanout` takes effect only with the http transport of server mode; elsewhere it is refused."""

import pytest

from grpo_cli.config.load import build_config


def test_direct_fanout_without_http_is_refused():
    with pytest.raises(Exception, match="weight_fanout=direct changes nothing"):
        build_config("tiny-cpu", overrides=["rollout.server.weight_fanout=direct"])


def test_direct_fanout_with_http_server_mode_is_kept():
    cfg = build_config("tiny-cpu-server", overrides=["rollout.server.weight_fanout=direct",
                                                     "rollout.server.weight_transport=http"])
    assert cfg.rollout.server.weight_fanout == "direct" and cfg.rollout.transport == "http"
