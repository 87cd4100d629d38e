"""Datasets: embedded ones that ship inside installed packages (digits, pydoc_text) and the
paper's real ones (CIFAR-10/100, ImageNet-1k, FineWeb-Edu), built by name from the Hydra `data`
config group."""


from laplace.errors import UserError


class DatasetNotFoundError(UserError, FileNotFoundError):
    """A dataset is not where the config says. The message is one line: what was looked for,
    where, and how to get it (which config key to set)."""
