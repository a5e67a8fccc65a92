"""The devices: see README.md beside this file."""
