"""The end of a capture: the exception as evidence, the live objects and the user's namespace read into plain records."""
