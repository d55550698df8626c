"""Which mode a %%dataparallel cell runs in (gpumagic.dataparallel.kernel.detect.choose_mode).

Launch mode for cells whose code distributes by itself (Hugging Face Trainer,
accelerate, Lightning, their own DDP / FSDP / init_process_group), gpumagic's
DDP for a hand-written loop; a UsageError for cells that start processes of
their own or use a framework trainer made in the kernel.
"""
from __future__ import annotations

import ast
import sys
import textwrap

import pytest
import torch
from IPython.core.error import UsageError

from gpumagic.dataparallel.kernel.detect import choose_mode

LOOP = """\
for x, y in loader:
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
"""


def mode(cell: str, ns: dict | None = None, used: list[str] | None = None, launch: bool = False):
    ns = {} if ns is None else ns
    return choose_mode(ast.parse(textwrap.dedent(cell)), ns, list(ns) if used is None else used, launch=launch)


def notebook(source: str) -> dict:
    """A notebook namespace after running ``source`` as a cell."""
    ns: dict = {"__name__": "__main__"}
    exec(compile(textwrap.dedent(source), "<notebook>", "exec"), ns)
    return ns


def loop_namespace() -> dict:
    model = torch.nn.Linear(4, 1)
    data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randn(8, 1))
    return {"torch": torch, "model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1),
            "ds": data, "loader": torch.utils.data.DataLoader(data, batch_size=4)}


# --- the cell's own imports: nothing imported to decide -------------------------------------------

@pytest.mark.parametrize("cell, why", [
    ("import transformers\ntrainer = transformers.Trainer(model=model, args=args)",
     "the cell builds a Hugging Face Trainer (transformers.Trainer)"),
    ("from transformers import Seq2SeqTrainer\ntrainer = Seq2SeqTrainer(model=model)",
     "the cell builds a Hugging Face Trainer (transformers.Seq2SeqTrainer)"),
    ("from accelerate import Accelerator\naccelerator = Accelerator()",
     "the cell builds an accelerate Accelerator (accelerate.Accelerator)"),
    ("import lightning as L\ntrainer = L.Trainer(max_epochs=1)",
     "the cell builds a Lightning Trainer (lightning.Trainer)"),
    ("import lightning.pytorch as pl\ntrainer = pl.Trainer(max_epochs=1)",
     "the cell builds a Lightning Trainer (lightning.pytorch.Trainer)"),
    ("import lightning.pytorch\ntrainer = lightning.pytorch.Trainer(max_epochs=1)",
     "the cell builds a Lightning Trainer (lightning.pytorch.Trainer)"),
    ("from pytorch_lightning import Trainer\ntrainer = Trainer()",
     "the cell builds a Lightning Trainer (pytorch_lightning.Trainer)"),
    ("from lightning.fabric import Fabric\nfabric = Fabric(devices=2)",
     "the cell builds a Lightning Fabric (lightning.fabric.Fabric)"),
    ("import lightning\nfabric = lightning.Fabric()", "the cell builds a Lightning Fabric (lightning.Fabric)"),
    # Lightning's examples start with LightningCLI, which builds the Trainer inside (args=[...] in a notebook)
    ("from lightning.pytorch.cli import LightningCLI\ncli = LightningCLI(Model, Data, args=['fit'])",
     "the cell builds a Lightning CLI, which builds a Lightning Trainer (lightning.pytorch.cli.LightningCLI)"),
    ("from pytorch_lightning.cli import LightningCLI\ncli = LightningCLI(Model, args=['fit'])",
     "the cell builds a Lightning CLI, which builds a Lightning Trainer (pytorch_lightning.cli.LightningCLI)"),
    ("from torch.nn.parallel import DistributedDataParallel as DDP\nmodel = DDP(model)",
     "the cell builds its own DistributedDataParallel (torch.nn.parallel.DistributedDataParallel)"),
    ("from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\nmodel = FSDP(model)",
     "the cell builds FSDP (torch.distributed.fsdp.FullyShardedDataParallel)"),
    ("from torch.distributed.fsdp import fully_shard\nfully_shard(model)",
     "the cell builds FSDP (fully_shard) (torch.distributed.fsdp.fully_shard)"),
    ("import torch.distributed as dist\ndist.init_process_group('gloo')\n" + LOOP,
     "the cell calls init_process_group (torch.distributed.init_process_group)"),
])
def test_cell_imports_choose_launch_naming_what(cell, why):
    assert mode(cell) == ("launch", why)


# --- names resolved in the notebook --------------------------------------------------------------

def test_a_lightning_cli_imported_in_the_kernel_chooses_launch():
    cli = pytest.importorskip("lightning.pytorch.cli")
    ns = {"LightningCLI": cli.LightningCLI}
    assert mode("cli = LightningCLI(Model, args=['fit'])", ns, ["LightningCLI"]) == (
        "launch", "the cell builds a Lightning CLI, which builds a Lightning Trainer (LightningCLI)")


def test_notebook_classes_match_through_their_bases():
    transformers = pytest.importorskip("transformers")
    ns = notebook("""\
        import transformers
        class MyTrainer(transformers.Trainer):
            pass
        """)
    ns["Seq2SeqTrainer"] = transformers.Seq2SeqTrainer
    ns["HFTrainer"] = transformers.Trainer
    assert mode("t = HFTrainer(model=m)", ns, ["HFTrainer"]) == (
        "launch", "the cell builds a Hugging Face Trainer (HFTrainer)")
    assert mode("t = Seq2SeqTrainer(model=m)", ns, ["Seq2SeqTrainer"]) == (
        "launch", "the cell builds a Hugging Face Trainer (Seq2SeqTrainer)")
    # A subclass made in an earlier cell: its module is __main__, its base is the Trainer.
    assert ns["MyTrainer"].__module__ == "__main__"
    assert mode("t = MyTrainer(model=m)", ns, ["MyTrainer"]) == (
        "launch", "the cell builds a Hugging Face Trainer (MyTrainer)")


def test_subclass_defined_in_the_cell_is_seen_through_its_base():
    transformers = pytest.importorskip("transformers")
    ns = {"Trainer": transformers.Trainer}
    cell = """\
        class WeightedTrainer(Trainer):
            def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
                return super().compute_loss(model, inputs, return_outputs, **kwargs)
        trainer = WeightedTrainer(model=model)
        """
    assert mode(cell, ns, ["Trainer"]) == ("launch", "the cell builds a Hugging Face Trainer (Trainer)")


def test_notebook_modules_resolve_attribute_chains():
    accelerate = pytest.importorskip("accelerate")
    lightning = pytest.importorskip("lightning")
    assert mode("acc = accelerate.Accelerator(cpu=True)", {"accelerate": accelerate}) == (
        "launch", "the cell builds an accelerate Accelerator (accelerate.Accelerator)")
    assert mode("t = L.Trainer(max_epochs=1)", {"L": lightning}) == (
        "launch", "the cell builds a Lightning Trainer (L.Trainer)")
    assert mode("t = lightning.pytorch.Trainer()", {"lightning": lightning}) == (
        "launch", "the cell builds a Lightning Trainer (lightning.pytorch.Trainer)")
    assert mode("f = L.Fabric(accelerator='cpu')", {"L": lightning}) == (
        "launch", "the cell builds a Lightning Fabric (L.Fabric)")
    ns = loop_namespace()
    assert mode("m = torch.nn.parallel.DistributedDataParallel(model)", ns) == (
        "launch", "the cell builds its own DistributedDataParallel (torch.nn.parallel.DistributedDataParallel)")
    assert mode("torch.distributed.init_process_group('gloo')", ns) == (
        "launch", "the cell calls init_process_group (torch.distributed.init_process_group)")
    assert mode("torch.distributed.fsdp.fully_shard(model)", ns) == (
        "launch", "the cell builds FSDP (fully_shard) (torch.distributed.fsdp.fully_shard)")


def test_notebook_function_that_builds_a_trainer_chooses_launch():
    pytest.importorskip("transformers")
    ns = notebook("""\
        import transformers
        def make_trainer(model, args):
            return transformers.Trainer(model=model, args=args)
        def train(model, args):
            def inner():
                return transformers.Trainer(model=model, args=args).train()
            return inner()
        """)
    assert mode("trainer = make_trainer(model, args)", ns, ["make_trainer"]) == (
        "launch", "the cell builds a Hugging Face Trainer (transformers.Trainer)")
    # Through a function nested in the one the cell calls.
    assert mode("train(model, args)", ns, ["train"])[0] == "launch"


def test_notebook_function_that_calls_init_process_group_chooses_launch():
    ns = notebook("""\
        import torch.distributed as dist
        def setup():
            dist.init_process_group("gloo")
        """)
    assert mode("setup()", ns, ["setup"]) == (
        "launch", "the cell calls init_process_group (dist.init_process_group)")


@pytest.mark.parametrize("body", [
    "torch.distributed.init_process_group('gloo')",
    "return torch.nn.parallel.DistributedDataParallel(model)",
])
def test_notebook_function_with_fully_qualified_torch_call_chooses_launch(body):
    ns = notebook(f"""\
        import torch
        def train(model):
            {body}
        """)
    assert mode("train(model)", ns, ["train", "model"])[0] == "launch"


def test_notebook_function_called_through_a_helper_chooses_launch():
    pytest.importorskip("transformers")
    ns = notebook("""\
        import transformers
        def build(model, args):
            return transformers.Trainer(model=model, args=args)
        def train(model, args):
            return build(model, args).train()
        """)
    assert mode("train(model, args)", ns, ["train"])[0] == "launch"


def test_cell_importing_trl_sft_trainer_chooses_launch():
    assert mode("from trl import SFTTrainer\ntrainer = SFTTrainer(model=model)")[0] == "launch"


def test_imports_inside_notebook_functions_and_methods_choose_launch():
    ns = notebook("""\
        def helper():
            from accelerate import Accelerator
            return Accelerator()
        def spawns():
            import torch.multiprocessing as mp
            mp.spawn(print, nprocs=2)
        class Experiment:
            def run(self):
                import lightning as L
                return L.Trainer()
        experiment = Experiment()
        """)
    assert mode("a = helper()", ns, ["helper"])[0] == "launch"
    assert mode("experiment.run()", ns, ["experiment"]) == (
        "launch", "the cell builds a Lightning Trainer (lightning.Trainer)")
    with pytest.raises(UsageError, match="starts processes of its own"):
        mode("spawns()", ns, ["spawns"])


def test_functions_from_a_module_imported_before_are_read(tmp_path, monkeypatch):
    (tmp_path / "users_training.py").write_text(
        "def main(model):\n    from transformers import Trainer\n    return Trainer(model=model)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "users_training", raising=False)
    # not imported yet: nothing is imported to decide (the ranks refuse it as it runs instead)
    assert mode("from users_training import main\nmain(model)")[0] == "ddp"
    import users_training  # noqa: F401 - as an earlier cell would
    assert mode("from users_training import main\nmain(model)") == (
        "launch", "the cell builds a Hugging Face Trainer (transformers.Trainer)")
    assert mode("import users_training\nusers_training.main(model)")[0] == "launch"


def test_a_method_named_like_a_notebook_function_is_not_that_function():
    """``model.train()`` inside a loop function is a method call, not the notebook's ``train`` (which
    builds a Trainer): the loop stays gpumagic's DDP."""
    pytest.importorskip("transformers")
    ns = notebook("""\
        import transformers
        def train(model, ds, args):
            return transformers.Trainer(model=model, args=args, train_dataset=ds).train()
        def train_epoch(model, loader, opt):
            model.train()
            for x, y in loader:
                opt.zero_grad(); ((model(x) - y) ** 2).mean().backward(); opt.step()
        """)
    assert mode("train_epoch(model, loader, opt)", ns, ["train_epoch"]) == ("ddp", "a hand-written loop")
    assert mode("train(model, ds, args)", ns, ["train"])[0] == "launch"


def test_library_functions_are_matched_by_name_not_read():
    ns = loop_namespace()
    # torch's own code refers to DistributedDataParallel and init_process_group in places; a loop
    # that calls torch functions is still a hand-written loop.
    cell = LOOP + "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\ntorch.save(model, 'm.pt')\n"
    assert mode(cell, ns, ["loader", "opt", "torch", "model"]) == ("ddp", "a hand-written loop")


# --- hand-written loops ---------------------------------------------------------------------------

def test_hand_written_loop_is_ddp():
    ns = loop_namespace()
    assert mode(LOOP, ns, ["loader", "opt", "torch", "model"]) == ("ddp", "a hand-written loop")


def test_loop_with_distributed_sampler_is_still_ddp():
    ns = loop_namespace()
    cell = ("sampler = torch.utils.data.distributed.DistributedSampler(ds, num_replicas=2, rank=0)\n"
            "loader = torch.utils.data.DataLoader(ds, batch_size=4, sampler=sampler)\n" + LOOP)
    assert mode(cell, ns) == ("ddp", "a hand-written loop")
    cell = "from torch.utils.data.distributed import DistributedSampler\nsampler = DistributedSampler(ds)\n" + LOOP
    assert mode(cell, ns) == ("ddp", "a hand-written loop")


def test_names_like_the_frameworks_without_their_package_are_ddp():
    ns = loop_namespace()
    ns["Trainer"] = type("Trainer", (), {})      # the notebook's own class of that name
    assert mode("t = Trainer()\n" + LOOP, ns) == ("ddp", "a hand-written loop")
    assert mode("from mylib import Trainer, Accelerator\nt = Trainer()\n" + LOOP) == ("ddp", "a hand-written loop")


def test_launch_flag_forces_launch_mode():
    ns = loop_namespace()
    assert mode(LOOP, ns, launch=True) == ("launch", "--launch")
    assert mode("from accelerate import Accelerator\na = Accelerator()", launch=True) == ("launch", "--launch")


# --- refused: processes of its own, trainers made in the kernel -----------------------------------

@pytest.mark.parametrize("cell, ns_names, called", [
    ("torch.multiprocessing.spawn(train, nprocs=2)", ["torch"], "torch.multiprocessing.spawn"),
    ("import torch.multiprocessing as mp\nmp.spawn(train, nprocs=2)", [], "torch.multiprocessing.spawn"),
    ("mp.spawn(train, args=(2,), nprocs=2)", ["mp"], "mp.spawn"),
    ("from accelerate import notebook_launcher\nnotebook_launcher(train, num_processes=2)", [],
     "accelerate.notebook_launcher"),
])
def test_cell_that_starts_processes_is_refused(cell, ns_names, called):
    import torch.multiprocessing
    available = {"torch": torch, "mp": torch.multiprocessing}
    ns = {n: available[n] for n in ns_names}
    for launch in (False, True):
        with pytest.raises(UsageError) as err:
            mode(cell, ns, launch=launch)
        assert f"the cell calls {called}, which starts processes of its own" in str(err.value)
        # the call that replaces it: notebook_launcher(fn, args) ran fn(*args), spawn ran fn(rank, *args)
        example = "training_function(*args)" if "launcher" in called else "train(int(os.environ['RANK']), *args)"
        assert f"(for example {example})" in str(err.value)


def test_accelerate_notebook_launcher_from_the_notebook_is_refused():
    accelerate = pytest.importorskip("accelerate")
    with pytest.raises(UsageError, match=r"accelerate\.notebook_launcher, which starts processes"):
        mode("accelerate.notebook_launcher(train, num_processes=2)", {"accelerate": accelerate})


def test_notebook_function_that_spawns_is_refused():
    ns = notebook("""\
        import torch.multiprocessing as mp
        def run():
            mp.spawn(print, nprocs=2)
        """)
    with pytest.raises(UsageError, match=r"the cell calls mp\.spawn, which starts processes of its own"):
        mode("run()", ns, ["run"])


def test_lightning_trainer_made_in_the_kernel_is_refused():
    lightning = pytest.importorskip("lightning")
    trainer = lightning.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False)
    ns = {"trainer": trainer, "lit": torch.nn.Linear(2, 2)}
    with pytest.raises(UsageError) as err:
        mode("trainer.fit(lit)", ns, ["trainer", "lit"])
    assert str(err.value).startswith("'trainer' is a Lightning Trainer made in the kernel")
    # launch=True changes nothing: the trainer still counted one process.
    with pytest.raises(UsageError, match="'trainer' is a Lightning Trainer"):
        mode("trainer.fit(lit)", ns, ["trainer", "lit"], launch=True)
    # Not read by the cell: not in the way.
    assert mode(LOOP, {**ns, **loop_namespace()}, ["loader", "opt", "model", "torch"]) == (
        "ddp", "a hand-written loop")


def test_lightning_fabric_made_in_the_kernel_is_refused():
    lightning = pytest.importorskip("lightning")
    fabric = lightning.Fabric(accelerator="cpu", devices=1)
    with pytest.raises(UsageError, match="'fabric' is a Lightning Fabric made in the kernel"):
        mode("model, opt = fabric.setup(model, opt)", {"fabric": fabric}, ["fabric"])


def test_accelerator_and_hf_trainers_made_in_the_kernel_are_refused():
    # Instances without __init__: their type is what is checked, and a real Accelerator or Trainer
    # would set accelerate's process-wide state in the test process.
    accelerate = pytest.importorskip("accelerate")
    transformers = pytest.importorskip("transformers")
    cases = [("accelerator", accelerate.Accelerator, "an accelerate Accelerator"),
             ("trainer", transformers.Trainer, "a Hugging Face Trainer"),
             ("s2s", transformers.Seq2SeqTrainer, "a Hugging Face Trainer")]
    for name, cls, what in cases:
        ns = {name: cls.__new__(cls)}
        with pytest.raises(UsageError) as err:
            mode(f"{name}.train()", ns, [name])
        assert str(err.value).startswith(f"{name!r} is {what} made in the kernel, where it counted one process")


def test_training_arguments_from_the_kernel_are_not_refused(tmp_path):
    transformers = pytest.importorskip("transformers")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[])
    ns = {"args": args, "Trainer": transformers.Trainer, "model": torch.nn.Linear(2, 2)}
    assert mode("trainer = Trainer(model=model, args=args)\ntrainer.train()", ns) == (
        "launch", "the cell builds a Hugging Face Trainer (Trainer)")
    assert mode("print(args.output_dir)", {"args": args}) == ("ddp", "a hand-written loop")
