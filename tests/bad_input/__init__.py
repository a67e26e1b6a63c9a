"""The bad-input suite (issue 9): one test per bad input a user can give Eddy, by area. Each
asserts the message that names the problem (key, value, file, row), or the logged and counted
skip, and that nothing already written (a checkpoint, a transcript) is lost."""
