"""``python -m kernelcrew``: the same command line as ``kernelcrew``."""

from kernelcrew.cli import app

app(prog_name="kernelcrew")
