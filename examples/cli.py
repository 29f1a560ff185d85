"""The digits example through LightningCLI: the strategy is chosen and configured in YAML or flags.

    horovodrun -np 2 -H localhost:2 --gloo python examples/cli.py fit --config examples/config.yaml
    python examples/cli.py fit --config examples/config.yaml --trainer.devices 2   # starts its 2 workers itself
    python examples/cli.py fit --config examples/config.yaml --trainer.strategy.init_args.compression none
    mpirun -np 2 --bind-to none python examples/cli.py fit --config examples/config.yaml  # OpenMPI starts them
    srun --mpi=pmix python examples/cli.py fit --config examples/config.yaml  # inside a Slurm job

``--trainer.strategy`` takes a class path and its init args (see config.yaml), or a registered
name such as ``horovod_fp16``. Rank 0 prints the validation accuracy at the end.
"""

from __future__ import annotations

from digits import DigitsClassifier, DigitsData
from lightning.pytorch.cli import LightningCLI

import hvd_plugins  # noqa: F401  (registers the "horovod*" strategy names)


class DigitsCLI(LightningCLI):
    def after_fit(self) -> None:
        accuracy = float(self.trainer.callback_metrics["val_acc"])  # reduced over all workers
        if self.trainer.is_global_zero:
            print(f"validation accuracy: {accuracy:.4f}")


def main() -> None:
    DigitsCLI(DigitsClassifier, DigitsData, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
