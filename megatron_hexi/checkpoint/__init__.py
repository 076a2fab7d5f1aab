"""Checkpoints: safetensors with global offsets, written atomically, loadable under any plan.

Layout of a save directory (Megatron-LM's names for the pointer and the iteration folders):

    DIR/latest_checkpointed_iteration.txt      "12" (or "release" for an imported model)
    DIR/iter_0000012/checkpoint.json           rank 0: iteration, consumed samples, plan, model,
                                               lr scheduler, Adam step, RNG states per rank, index
    DIR/iter_0000012/rank_00003.safetensors    one file per rank that writes something

Every tensor in a rank file is a contiguous range [start, start + length) along one dimension
(`dim`) of a canonical one-device tensor (planner/layout.py), of one kind: "param" (fp32 master
weights), "exp_avg" or "exp_avg_sq" (Adam's moments share the parameter layout), or
"momentum_buffer" (--optimizer sgd). Under islands (planner.islands) island k > 0 writes its own
as "island<k>.<kind>", and the outer step's state is written once as "outer_param" and
"outer_momentum"; checkpoint.json records the island count, each island's site (`island_sites`)
and the fragments whose outer step waits to be written. A plan loads a checkpoint of one island
(every island starts from its weights and optimizer state, the outer step afresh), or one whose
islands it can match (planner.island_match): each island continues from the saved island of its
site (by index where either side names no sites), the outer state carries over, and after a lost
site the outer steps average the islands that remain; an island on a site that comes back starts
from the outer parameters. The model is cut
into the atomic segments of the gradient sync, and each segment is written exactly once (per
island), by the least-loaded rank that holds it (TP replicas and pipeline replicas are not
written twice).
Loading reads, for every local piece, the overlapping ranges from whichever files hold them
(safetensors `get_slice`: a rank reads only what it needs), so a checkpoint saved under plan A
loads under plan B of the same model; the optimizer state reshards the same way.

Saving is atomic: rank 0 makes `DIR/.iter_0000012.tmp`, every rank writes and fsyncs its file
there, rank 0 writes checkpoint.json, fsyncs the directory and renames it to `iter_0000012`, and
only then replaces the pointer file (temporary name, fsync, rename). A save killed at any point
leaves the previous checkpoint and its pointer untouched. Phases are separated by a collective
status exchange (a barrier under the --distributed-timeout-minutes timeout) so that a failure on
one rank fails the save on every rank; a save that fails (a disk full while writing a rank file or
checkpoint.json) removes its temporary directory, and the next save removes what a killed one
left. A save refuses NaN or inf in any tensor it would write (weights or Adam moments, each rank
checking its own before writing; the ranks agree in the status exchange), as loading would refuse
them: the error names the tensor and the last complete checkpoint, which stays the one to resume.

Integrity. Each tensor's bytes as written (row-major, in file order) are cut into blocks of
`block_bytes` (BLOCK_BYTES, 1 MiB; the last block may be shorter), and each block's CRC-32 is
computed while the rank file is written; the file's safetensors metadata holds its index rows
(with the block checksums), the block size, the iteration and the save id (a random token rank 0
draws for each save and sends to every rank in the save's first status exchange). checkpoint.json
lists the same rows per file, the block size, the iteration, the save id, and a checksum of its
own content. Blocks, not whole tensors, so that verifying costs what reading costs: a load checks
only the blocks that overlap the bytes it reads (a slice along a tensor's first dimension is one
byte range, a few blocks; one along an inner dimension touches every row, often every block),
each block once per tensor however many slices of it a rank reads; a full read (export, a load
under the saving plan) checks every block, so any changed byte is found. Damage in bytes that a
rank does not read goes unseen by that rank: nothing wrong was loaded. Loading (--load under any
plan, export, tests) refuses, with one error naming the file and the key or tensor:
  * a checkpoint.json with a missing or malformed key, an iteration that is not the one its
    directory and pointer name, or content that does not match its own checksum (edited);
  * a rank file of another save (iteration or save id differ from checkpoint.json's) or whose
    tensor list differs from checkpoint.json's;
  * a block of a tensor that does not match its checksum (naming the block and its bytes), or a
    slice read that holds NaN or inf.
`load` runs every check inside its status exchange, so all ranks report the same error. The checks
run on a few threads (VERIFY_THREADS) while the data is copied into the trainer; a failed load
leaves the trainer unusable and ends the process.

A checkpoint reads a trainer through `TrainState` (plan, plan rank, local parameters, optimizer,
schedule). The modules, one concern each:

    format      names, kinds, index rows and the `Entry` a save writes
    integrity   block checksums, the NaN/inf checks, checkpoint.json's own checksum
    commit      fsync, the atomic rename, the pointer, the cross-rank status exchange
    state       which ranges a rank owns, optimizer and RNG state, `TrainState`
    writer      rank files and the collective save
    reader      checkpoint.json's checks and `Checkpoint`, which reads and verifies ranges
    loader      the collective load into a trainer
"""

from megatron_hexi.checkpoint.commit import (
    agree,
    behind_foreign_pointer,
    commit_directory,
    write_pointer,
)
from megatron_hexi.checkpoint.format import (
    FORMAT_VERSION,
    ITEMSIZE,
    KINDS,
    NOT_COMPARED,
    RANK_FILE,
    Entry,
    entry_key,
    iteration_dir_name,
    rank_file_name,
    tensor_bytes,
)
from megatron_hexi.checkpoint.integrity import (
    BLOCK_BYTES,
    CHECKSUM,
    block_checksums,
    blocks_bytes,
    meta_checksum,
    non_finite,
    overlapping_blocks,
)
from megatron_hexi.checkpoint.loader import Loaded, load
from megatron_hexi.checkpoint.reader import (
    VERIFY_THREADS,
    Checkpoint,
    check_meta,
    checkpoint_exists,
    last_loadable,
    pointed_step,
    read_full_model,
)
from megatron_hexi.checkpoint.state import (
    OwnedRange,
    TrainState,
    local_runs,
    owned_ranges,
    restore_optimizer,
    rng_state,
    set_rng_state,
    writer_segments,
)
from megatron_hexi.checkpoint.writer import save, save_params_only, write_rank_file
from megatron_hexi.checkpoint_files import FORMAT, METADATA, TRACKER, CheckpointError

__all__ = [
    "BLOCK_BYTES",
    "CHECKSUM",
    "FORMAT",
    "FORMAT_VERSION",
    "ITEMSIZE",
    "KINDS",
    "METADATA",
    "NOT_COMPARED",
    "RANK_FILE",
    "TRACKER",
    "VERIFY_THREADS",
    "Checkpoint",
    "CheckpointError",
    "Entry",
    "Loaded",
    "OwnedRange",
    "TrainState",
    "agree",
    "behind_foreign_pointer",
    "block_checksums",
    "blocks_bytes",
    "check_meta",
    "checkpoint_exists",
    "commit_directory",
    "entry_key",
    "iteration_dir_name",
    "last_loadable",
    "load",
    "local_runs",
    "meta_checksum",
    "non_finite",
    "overlapping_blocks",
    "owned_ranges",
    "pointed_step",
    "rank_file_name",
    "read_full_model",
    "restore_optimizer",
    "rng_state",
    "save",
    "save_params_only",
    "set_rng_state",
    "tensor_bytes",
    "write_pointer",
    "write_rank_file",
    "writer_segments",
]
