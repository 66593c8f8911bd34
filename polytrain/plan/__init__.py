"""`polytrain plan`: which layouts fit a spec's model on N ranks, what each rank holds and sends per step, and the
one to run (`command`); the census (`census`), the formulas (`memory`, `activations`, `comms`), the candidates and
their ranking (`candidates`), the link probe (`probe`). No framework is imported until a census is taken."""
