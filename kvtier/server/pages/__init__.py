"""The page manager: see README.md beside this file."""
