"""`python -m compute.zoo ship [NAMES...]`: retrain and rewrite the shipped weights."""

from compute.zoo.build import main

if __name__ == "__main__":
    main()
