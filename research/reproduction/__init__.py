"""The paper-reproduction harness: experiments, past studies and their results.

Not part of the `keras_duq` package. Run its scripts from the repository
root as modules, for example `python -m research.reproduction.fashion_mnist --help`;
README.md in this folder says what each one reproduces.
"""
