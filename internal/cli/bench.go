package cli

// benchCmd groups the measurements.
type benchCmd struct {
	IPC   BenchIPCCmd   `cmd:"" name:"ipc" help:"Measure GPU sharing between processes against C, the hardware and host staging."`
	Store benchStoreCmd `cmd:"" help:"Measure get+release round trips against the object store."`
}
