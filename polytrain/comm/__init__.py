"""How ranks reach each other beside the training collectives: ports, addresses and listeners (`net`), the one MPI
numpy transport (`mpi_transport`, `mpi_singleton`), and one rank's work made every rank's outcome (`settle`)."""
