"""rlfleet command line."""


def main() -> None: ...
