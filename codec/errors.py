"""The one exception the codec raises for bad input: damaged, truncated, foreign or
mismatched bitstreams and profiles. Its message says what is wrong."""


class CodecError(ValueError):
    """A bitstream or profile that cannot be decoded or used; never a wrong tensor."""
