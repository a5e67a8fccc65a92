"""Pure parsers of /proc and /sys text: functions of a string, no I/O, no torch."""
