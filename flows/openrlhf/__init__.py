"""OpenRLHF launch scripts -> this project's stage and flow configs: `rlhf-flows import-openrlhf SCRIPT [-- ARG...]`.
Not a flow: the importer's own room.

    shell.py      the script read as bash reads it: the OpenRLHF commands it runs, with their flags
    flags.py      the flag tables (flags.yaml, data) as rules: OpenRLHF flag -> stage key, OpenRLHF's defaults
    importer.py   a command read as OpenRLHF reads it -> the stage sections, the output, its validation
    loops.py      a script's batch_inference + trainer commands as one pipeline, its loop as a flow's config
"""
