"""The kvshelf cache server: shared-memory arena, index, socket loop and command line."""
