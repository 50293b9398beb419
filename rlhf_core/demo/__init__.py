"""The demo's pieces, built from a seed with nothing downloaded: tiny tokenizers and models of several
architectures (tiny.py: the tests' model zoo too) and the "make the review positive" task with its programmatic
gold reward (demo_task.py). Imports nothing else of rlhf_core."""
