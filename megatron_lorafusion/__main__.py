"""`python -m megatron_lorafusion ...` is the `lorafusion` command."""

from megatron_lorafusion.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
