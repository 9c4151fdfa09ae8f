"""Exceptions for user errors: the CLI prints them without a traceback and exits with code 2."""


class FinetuneError(Exception):
    """A problem the user can fix (bad recipe, bad data, missing file)."""


class DataError(FinetuneError):
    """A dataset could not be loaded, formatted or prepared."""


class RecipeError(FinetuneError):
    """The recipe file or its overrides are invalid."""
