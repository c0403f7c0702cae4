r"""jssl's entry point from a checkout, the same as the installed ``jssl`` command.

  python launch.py --config=configs/moco.py:demo --workdir=runs/demo
  python launch.py --config=configs/moco.py --config.optim.base_lr=0.06 --workdir=runs/moco

Flags, exit status and multi-host use: see jssl/cli.py.
"""

from jssl import cli

if __name__ == "__main__":
    cli.main()
