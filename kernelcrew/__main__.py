"""``python -m kernelcrew`` and the ``kernelcrew`` command."""


def main() -> None:
    from kernelcrew.tools.pycache import use_in_this_process

    use_in_this_process()  # before the command line's imports (typer, langgraph, torch)
    from kernelcrew.cli import app

    app(prog_name="kernelcrew")


if __name__ == "__main__":
    main()
