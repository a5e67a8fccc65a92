"""kvtop: the live terminal view of every tier, session and host signal."""
