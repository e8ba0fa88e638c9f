"""A pipeline job written as a training script usually is: everything inside main(), the stage
closed at its end and dropped when main() returns (the interpreter then exits)."""
import torch

from rdmaflow import graph


def main() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    pipe = graph.pipeline(model, (torch.randn(8, 8),), split_spec={"2": graph.SplitPoint.BEGINNING})
    stage = pipe.build_stage()
    schedule = graph.ScheduleGPipe(stage, 2, loss_fn=torch.nn.functional.mse_loss)
    for _ in range(3):
        schedule.step(torch.randn(16, 8), target=torch.randn(16, 2))
    stage.close()
    print(f"rank {stage.stage_index} closed", flush=True)


main()
