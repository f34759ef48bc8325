"""PowerSGD whose state a checkpoint can hold: keyed by parameter name, not by DDP bucket (recipes/ddp_comm_hooks.py).

torch's PowerSGDState keeps its error feedback and its warm-start matrices P and Q under the index of the DDP bucket
they came from. DDP lays its buckets out again after the first step of every process (by the order the gradients
became ready; the first step runs with one bucket of everything; not so with find_unused_parameters=True), so the
buckets of a resumed process's first step are not the ones the state was saved under: restored by index, the state
raises on a size mismatch (resnet18: 1 bucket, then 3), or, where the sizes happen to agree, adds one parameter's
error to another's gradient without a word.

PowerSGDByParameter wraps torch's powerSGD_hook. Whenever a bucket holds other parameters than the state under its
index was built for, it splits the old buckets' state into per-parameter pieces and joins the new bucket's from them.
state_dict() / load_state_dict() go through the same pieces, so a checkpoint fits any bucket layout. Local: no
collective here (the recipe all-reduces the error feedback itself, where you can see it).
"""

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD

PIECES = ("error", "p", "q")  # error feedback: one per gradient element; P and Q: the compressed matrices' factors


class PowerSGDByParameter:
    def __init__(self, model, **powersgd_args):
        """model: the module DDP wraps (its named_parameters name the pieces); powersgd_args: PowerSGDState's."""
        if powersgd_args.get("batch_tensors_with_same_shape"):  # then P and Q follow shape groups, not parameters
            raise ValueError("PowerSGDByParameter keys P and Q by parameter: batch_tensors_with_same_shape=False")
        self.state = powerSGD.PowerSGDState(process_group=None, **powersgd_args)
        self.names = {param: name for name, param in model.named_parameters()}
        self.shapes = {name: param.shape for name, param in model.named_parameters()}
        self.layout = {}  # bucket index -> the parameter names its state in self.state was built for, in order
        self.loose = {piece: {} for piece in PIECES}  # per-parameter state not (yet) in any bucket's

    def hook(self, state, bucket):
        """The comm hook: model.register_comm_hook(powersgd.state, powersgd.hook)."""
        index, names = bucket.index(), [self.names[param] for param in bucket.parameters()]
        if self.layout.get(index) != names:  # a new process, or DDP rebuilt its buckets
            for old in [i for i, old_names in self.layout.items() if i == index or set(old_names) & set(names)]:
                self._unbucket(old, self.loose)  # that step's buckets are all reduced: no hook still writes them
            self._bucket(index, names, bucket.buffer().device)
        reduced = powerSGD.powerSGD_hook(state, bucket)
        if dist.get_backend(state.process_group) == "gloo":  # one bucket at a time, or two buckets can hang the job
            # powerSGD_hook's .then() callbacks each start an all-reduce and .wait() for it, on a gloo worker thread
            # (a process group has 2): two buckets' callbacks at once take both threads, and the all-reduces they wait
            # for have no thread left to run on (seen: 1 run in 7 of tests/test_comm_hooks.py's bucket test hung).
            # (gloo's threads are the same for CUDA tensors: launch.sh G:N.)
            reduced.wait()  # the backward waits for this bucket; on NCCL the hook overlaps as torch wrote it
        return reduced

    def state_dict(self):
        """{"iter", "error", "p", "q"}: this rank's state, each piece a {parameter name: tensor} (copies)."""
        pieces = {piece: dict(self.loose[piece]) for piece in PIECES}
        for index in self.layout:
            self._unbucket(index, pieces, keep=True)
        copies = {piece: {name: t.clone() for name, t in pieces[piece].items()} for piece in PIECES}
        return {"iter": self.state.iter, **copies}

    def load_state_dict(self, saved):
        """Before the first step: the buckets take their pieces in the hook, whatever their layout."""
        unknown = set().union(*(saved[piece] for piece in PIECES)) - set(self.shapes)
        if unknown:
            raise ValueError(f"PowerSGD state for parameters this model does not have: {sorted(unknown)[:3]}")
        expected = {piece: dict(self._sizes(piece, list(self.shapes))) for piece in PIECES}
        wrong = [f"{piece} of {name}" for piece in PIECES for name, t in saved[piece].items()
                 if t.numel() != expected[piece].get(name)]
        if wrong:  # another matrix_approximation_rank, or another model
            raise ValueError(f"PowerSGD state of another size than this run's: {', '.join(wrong[:3])}")
        self.state.iter = saved["iter"]
        self.loose = {piece: dict(saved[piece]) for piece in PIECES}
        self.layout = {}
        for memory in (self.state.error_dict, self.state.p_memory_dict, self.state.q_memory_dict):
            memory.clear()

    # ------------------------------------------------------------------------------------------------------
    def _factors(self, name):
        """(rows of P, rows of Q) for a parameter PowerSGD compresses, None for one it all-reduces whole."""
        shape = self.shapes[name]
        n, m = shape[0], shape.numel() // shape[0]  # the hook's tensor.view(tensor.shape[0], -1)
        rank = min(n, m, self.state.matrix_approximation_rank)
        compress = powerSGD._should_compress(n, m, rank, self.state.min_compression_rate)[0]
        return (n * rank, m * rank) if compress else None

    def _sizes(self, piece, names):
        """[(name, numel)] of a bucket's piece, in the order the hook lays it out: the error like the bucket's
        buffer; P and Q grouped by matrix shape, in order of each shape's first parameter (the hook's
        shape_to_tensors), then in bucket order."""
        if piece == "error":
            return [(name, self.shapes[name].numel()) for name in names]
        groups = {}
        for name in names:
            if self._factors(name):
                shape = self.shapes[name]
                groups.setdefault((shape[0], shape.numel() // shape[0]), []).append(name)
        return [(name, self._factors(name)[piece == "q"]) for group in groups.values() for name in group]

    def _memory(self, piece):
        return {"error": self.state.error_dict, "p": self.state.p_memory_dict, "q": self.state.q_memory_dict}[piece]

    def _unbucket(self, index, into, keep=False):
        names = self.layout[index] if keep else self.layout.pop(index)
        for piece in PIECES:
            memory = self._memory(piece)
            if index not in memory:
                continue
            flat = memory[index] if keep else memory.pop(index)
            sizes = self._sizes(piece, names)
            into[piece].update(zip([n for n, _ in sizes], flat.split([s for _, s in sizes]), strict=True))

    def _bucket(self, index, names, device):
        self.layout[index] = names
        for piece in PIECES:
            wanted = [name for name, _ in self._sizes(piece, names)]
            if wanted and all(name in self.loose[piece] for name in wanted):
                joined = torch.cat([self.loose[piece].pop(name).reshape(-1) for name in wanted])
                self._memory(piece)[index] = joined.to(device)
