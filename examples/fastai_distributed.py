"""fastai's own distributed training script, in the shape of its tutorial (`train_imagenette.py`:
`setup_distrib`, `rank0_first`, `learn.distrib_ctx()` or `learn.parallel_ctx()`), on a generated
table instead of a downloaded image set. The only change from the fastai script is its import:
`from unison.fastai import *` where it had `from fastai.distributed import *`.

    python examples/fastai_distributed.py --bs 64                      # one process
    unison launch --nproc 2 examples/fastai_distributed.py --bs 32     # two: the same global batch

As in fastai's tutorial, `--bs` is each process's batch: two processes at 32 train as one at 64
(unison prints the global batch when training starts). Rank 0 writes `--out` when given.
"""

# ruff: noqa: F403, F405  (star imports, as fastai scripts are written)
from fastai.tabular.all import *

from unison.fastai import *  # (fastai's tutorial: from fastai.distributed import *)


def make_table(path: Path, n: int = 1000, seed: int = 0) -> Path:
    """A made-up table written once (as the tutorial's `untar_data` download is), under `path`:
    `rank0_first` calls it on every rank, rank 0 first, and the others find the file there."""
    if (path / "table.csv").exists():
        return path / "table.csv"
    rng = np.random.RandomState(seed)
    df = pd.DataFrame(
        {"colour": rng.choice(["red", "green", "blue"], n), "a": rng.randn(n), "b": rng.randn(n) * 3 + 1}
    )
    df["label"] = np.where(df.a + 0.3 * df.b + (df.colour == "red") + 0.3 * rng.randn(n) > 0, "yes", "no")
    path.mkdir(parents=True, exist_ok=True)
    df.to_csv(path / "table.csv", index=False)
    return path / "table.csv"


@call_parse
def main(
    gpu: int = None,  # GPU to run on
    epochs: int = 2,  # number of epochs
    bs: int = 64,  # batch size of each process
    lr: float = 1e-2,  # learning rate
    folder: str = "data",  # folder for the generated table
    out: str = None,  # write the final weights here (rank 0)
):
    "A tabular model trained by fastai's distributed tutorial's steps."
    gpu = setup_distrib(gpu)
    n_gpu = torch.cuda.device_count()
    csv = rank0_first(make_table, Path(folder))
    set_seed(42)  # (every process deals the same order)
    dls = TabularDataLoaders.from_csv(
        csv,
        procs=[Categorify, Normalize],
        cat_names=["colour"],
        cont_names=["a", "b"],
        y_names="label",
        valid_idx=list(range(800, 1000)),
        bs=bs,
    )
    learn = tabular_learner(dls, layers=[16], metrics=accuracy)
    ctx = learn.parallel_ctx if gpu is None and n_gpu else learn.distrib_ctx
    with partial(ctx, gpu)():
        learn.fit_flat_cos(epochs, lr)
    if out and rank_distrib() == 0:
        torch.save({k: v.detach().cpu() for k, v in learn.model.state_dict().items()}, out)
