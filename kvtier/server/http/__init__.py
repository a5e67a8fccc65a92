"""The HTTP routes: see README.md beside this file."""
