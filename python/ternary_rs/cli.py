"""The ``ternary-rs`` command (placeholder until the conversion work lands)."""


def main(argv=None) -> int:
    raise SystemExit("ternary-rs: being built")
