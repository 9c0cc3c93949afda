"""The error type of bad user input to `deltafuse train` / `deltafuse bench`: printed as one line, no traceback."""


class TrainInputError(ValueError):
    """An argument, file, row or directory that training cannot use; the message names it and what is allowed."""
