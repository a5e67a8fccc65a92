"""Host collectors: thin readers of /proc, /sys and NVML around the pure parsers."""
