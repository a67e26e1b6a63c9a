"""Multi-node tests (issue 21): two "hosts" on this machine, each its own network and mount
namespace, and a real two-node Ray cluster across them (`hosts.py`, fixtures in conftest.py).
They need root and `ip netns`; they skip elsewhere."""
