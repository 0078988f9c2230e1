"""`unison check-exact`: the user's own script on 1 process and on W, and the difference between them.

`runs` starts the launches (`unison launch`, or forks of a process that preloaded torch:
`forked_launch`) and reads their probe records; `report` compares them and gives the verdict.

    # shell: unison check-exact --nproc 2 --steps 5 --float64 train.py
"""
