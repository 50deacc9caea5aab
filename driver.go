package cudaipc

import (
	"github.com/cudaipc/cudaipc/internal/cu"
)

// DefaultLibrary is the driver library loaded unless SetLibraryPath or the
// CUDAIPC_LIBCUDA environment variable names another.
const DefaultLibrary = cu.DefaultLibrary

// EnvLibrary is the environment variable that overrides the driver library
// path.
const EnvLibrary = cu.EnvLibrary

// SetLibraryPath sets the driver library to load. It must be called before
// any other function of this package; later it returns an error.
func SetLibraryPath(path string) error { return cu.SetLibrary(path) }

// LibraryPath returns the driver library path that is, or will be, loaded.
func LibraryPath() string { return cu.Library() }

// Init loads the driver and initializes it. Every other function calls it
// implicitly; call it to learn early whether a driver is present.
func Init() error { return cu.Init() }

// DriverVersion returns the CUDA version the driver supports, as
// 1000*major + 10*minor (13000 for CUDA 13.0).
func DriverVersion() (int, error) { return cu.DriverGetVersion() }
