"""The fault-injection suite (issue 19): each test replays a fault the probe found (a corrupt
checkpoint, a second run, a killed process, an escaping tool call) and asserts that nothing
is lost or corrupted and that the message names the cause."""
