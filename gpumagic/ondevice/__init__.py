"""``%%ondevice``: run a cell on a chosen device (:mod:`.run`), moving variables
there first (:mod:`.moves`), with side streams (:mod:`.streams`) and honest
timing (:mod:`.timing`).

In a notebook::

    %%ondevice cuda:1 --time
    y = model(x.cuda())
"""

__all__: list[str] = []
