"""Root of the tests: puts this folder on sys.path (pytest's prepend mode), so `support` imports."""
