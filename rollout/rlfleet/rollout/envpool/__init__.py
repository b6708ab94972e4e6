"""The EnvPool session server: sandboxes behind one authenticated HTTP port.

Standard library only and importing nothing else of rlfleet: the sandbox image copies this
folder alone, and runs `python -I -m rlfleet.rollout.envpool`."""
