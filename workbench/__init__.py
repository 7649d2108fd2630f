"""The memory-constrained training workbench: three studies of training language models on GPUs
that are too small (see README.md)."""

import logging
import sys
import warnings

# Part of every run's key: a finished run made by another version is not reused.
__version__ = "0.2.0"

if sys.platform == "win32":  # fcntl's file locks, DeepSpeed's CPU Adam build, make: none of them there
    raise ImportError("workbench runs on Linux; on Windows, run it in WSL2 (see README.md, 'On Windows')")


class _DropMessage(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in str(record.msg)


# Library messages no user can act on, which opened every `workbench estimate` (the third: of a
# GPT-2 model) with what reads like an error; each dropped by its exact text, every other message
# of those libraries kept:
# - bitsandbytes (on a CPU with AVX512-BF16, at import) failed to load its 4-bit inference kernel
#   from the hub. We never use that kernel: it has no backward, and core.trainable.keep_4bit_backward
#   switches it off on every 4-bit layer (it had silently broken QLoRA's gradient).
# - peft reads transformers 5's deprecated `is_gradient_checkpointing` on every model it wraps.
# - transformers 5 says "`loss_type=None` was set in the config but it is unrecognized" of every
#   model whose class name is not in its loss table (GPT2LMHeadModel): no config sets it, and the
#   loss it falls back to, ForCausalLMLoss, is the one a causal LM takes.
logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_DropMessage("kernels-community"))
# And DeepSpeed's, at import on a machine without CUDA (on standard output, before a command's own first
# line): "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."
# Where a GPU is wanted and CUDA cannot be reached, the workbench says so itself (`fallback.driver_too_old`,
# gpu-check's one line); on a CPU machine it is what every run intends.
logging.getLogger("DeepSpeed").addFilter(_DropMessage("Setting accelerator to CPU."))
logging.getLogger("transformers.modeling_utils").addFilter(_DropMessage("`loss_type=None` was set in the config"))
warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning)
