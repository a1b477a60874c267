"""The one exception the codec raises for bad input: damaged, truncated, foreign or
mismatched bitstreams and profiles. Its message says what is wrong. ProfileError is the
kind a command reports in one line: no profile to code a model with."""


class CodecError(ValueError):
    """A bitstream or profile that cannot be decoded or used; never a wrong tensor."""


class ProfileError(CodecError):
    """No profile to code a model with: none found for it, or a named file that does not load
    or is another model's (codec.tuning.registry.for_model)."""


class NoSharedMemory(CodecError):
    """A codec segment could not be reserved in /dev/shm (it is full): the chunk is not coded or
    decoded here now; never a wrong tensor, and never a fault on a page that is not there."""
