"""The sandbox core: lifecycle states, one sandbox's lifecycle, fan-out, the
manager of the collection, warm pool, background loops, and the service
layer every front end calls. Nothing in here knows HTTP."""
