"""Run supervision: signals, the stall watchdog, alarms, phase timing, trackers and the run folder. Imports
config, runtime and ui-free helpers only; nothing here changes what is trained."""
