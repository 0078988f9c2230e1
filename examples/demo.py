"""`make demo`: the main job. The digits CNN (BatchNorm, AdamW, one-cycle) trained on one process at
batch 64, then the same file on two processes at batch 32 each (`unison launch --nproc 2`), and the
two runs compared: weights, loss curve, accuracy. They agree to float rounding, which is what
unison is for. Where float32's rounding has grown past 1e-4 (it depends on the CPU and the
number of steps: BatchNorm and AdamW amplify it), the same steps are run again in float64 by
`unison check-exact`, whose verdict then decides (its records in runs/demo/check/records/).
Writes runs/demo/{one,two}/ and runs/demo/agree.png (both loss curves).

    python examples/demo.py
    python examples/demo.py --epochs 3     # shorter (the test suite's run)
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "train_digits.py"
OUT = Path("runs") / "demo"


def run(title: str, command: list[str], out: Path) -> dict:
    print(f"\n=== {title}: {' '.join(command[2:] if command[1] == '-m' else command[1:])}", flush=True)
    start = time.perf_counter()
    subprocess.run(command + ["--out", str(out)], check=True)
    history = json.loads((out / "history.json").read_text())
    history["weights"] = torch.load(out / "models" / "digits.pth", weights_only=True)["model"]
    history["seconds"] = time.perf_counter() - start
    return history


def plot(one: dict, two: dict, file: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(one["batch_losses"], label="1 process, batch 64", linewidth=3, alpha=0.5)
    ax.plot(two["batch_losses"], "--", label="2 processes, batch 32 each", linewidth=1.2)
    ax.set(xlabel="optimizer step", ylabel="training loss (global batch)", yscale="log")
    ax.set_title("unison: 2 processes train exactly as 1")
    ax.legend()
    fig.tight_layout()
    fig.savefig(file)


def main() -> None:
    parser = argparse.ArgumentParser(description="train_digits.py on 1 and on 2 processes, compared.")
    parser.add_argument("--epochs", type=int, default=8, help="epochs of each run")
    epochs = ["--epochs", str(parser.parse_args().epochs)]
    one = run("1 process", [sys.executable, str(SCRIPT), "--bs", "64", *epochs], OUT / "one")
    launch = [sys.executable, "-m", "unison.launch", "--nproc", "2", str(SCRIPT), "--bs", "32", *epochs]
    two = run("2 processes", launch, OUT / "two")

    gaps = {k: float((v.float() - two["weights"][k].float()).abs().max()) for k, v in one["weights"].items()}
    weights = max(gaps.values())
    trained = max(gap for k, gap in gaps.items() if "running" not in k)
    curve = max(abs(a - b) for a, b in zip(one["batch_losses"], two["batch_losses"], strict=True))
    acc_one, acc_two = one["epochs"][-1][-1], two["epochs"][-1][-1]
    plot(one, two, OUT / "agree.png")
    print("\n=== 1 process against 2 processes (same global batch of 64)")
    print(f"largest weight difference     {trained:.1e} (BatchNorm running statistics {weights:.1e})")
    print(f"largest loss-curve difference {curve:.1e} over {len(one['batch_losses'])} steps")
    print(f"valid accuracy                {acc_one:.4f} vs {acc_two:.4f}")
    print(f"loss curves plotted in {OUT / 'agree.png'}")
    if weights < 1e-4 and curve < 1e-4 and acc_one == acc_two:
        print("they agree: the 2-process run is the 1-process run")
        sys.exit(0)
    # float32 sums in another order on 2 processes; BatchNorm and AdamW can grow that rounding, and
    # a rounding difference can tip a discrete choice (a max-pooling tie) into a visible jump
    # (docs/exact.md). float64 shrinks the rounding by 1e9 and tells it from a real divergence.
    steps = len(one["batch_losses"])
    print(f"\n=== float32 differs by more than 1e-4: the same {steps} steps in float64 (unison check-exact)")
    check = [sys.executable, "-m", "unison.cli", "check-exact", "--nproc", "2", "--steps", str(steps)]
    check += ["--float64-only", "--batch-arg", "bs", "--keep", str(OUT / "check" / "records")]
    check += [str(SCRIPT), "--bs", "64", *epochs, "--out", str(OUT / "check")]
    exact = subprocess.run(check).returncode == 0
    print(
        "they agree: in float64 the 2-process run is the 1-process run; float32's difference is rounding"
        if exact
        else "THEY DIFFER"
    )
    sys.exit(0 if exact else 1)


if __name__ == "__main__":
    main()
