package cli

import (
	"fmt"
	"text/tabwriter"

	"github.com/cudaipc/cudaipc"
)

// InfoCmd prints the driver, the devices and the peer-access matrix.
type InfoCmd struct {
	JSON bool `help:"Print one JSON object."`
}

type deviceInfo struct {
	Ordinal           int    `json:"ordinal"`
	UUID              string `json:"uuid"`
	Name              string `json:"name"`
	PCIBusID          string `json:"pci_bus_id"`
	MemoryBytes       uint64 `json:"memory_bytes"`
	ComputeCapability string `json:"compute_capability"`
	LegacyIPC         bool   `json:"legacy_ipc"`
	IPCEvents         bool   `json:"ipc_events"`
	VMMFD             bool   `json:"vmm_posix_fd"`
}

type infoReport struct {
	// Error says why the rest is missing (no driver, no GPU access); set
	// only on failure, so that scripts reading --json always get JSON.
	Error         string       `json:"error,omitempty"`
	Library       string       `json:"library"`
	DriverVersion string       `json:"driver_cuda_version"`
	Devices       []deviceInfo `json:"devices"`
	// PeerAccess[i][j] reports whether device i can map memory of device j.
	PeerAccess [][]bool `json:"peer_access"`
}

func gatherInfo() (*infoReport, error) {
	if err := cudaipc.Init(); err != nil {
		return nil, err
	}
	v, err := cudaipc.DriverVersion()
	if err != nil {
		return nil, err
	}
	devs, err := cudaipc.Devices()
	if err != nil {
		return nil, err
	}
	r := &infoReport{Library: cudaipc.LibraryPath(), DriverVersion: fmt.Sprintf("%d.%d", v/1000, v%1000/10), Devices: []deviceInfo{}, PeerAccess: [][]bool{}}
	for _, d := range devs {
		maj, min := d.ComputeCapability()
		r.Devices = append(r.Devices, deviceInfo{
			Ordinal: d.Ordinal(), UUID: d.UUID().String(), Name: d.Name(), PCIBusID: d.PCIBusID(),
			MemoryBytes: d.TotalMemory(), ComputeCapability: fmt.Sprintf("%d.%d", maj, min),
			LegacyIPC: d.LegacyIPCSupported(), IPCEvents: d.IPCEventSupported(), VMMFD: d.VMMFDSupported(),
		})
		row := make([]bool, len(devs))
		for j, p := range devs {
			if row[j], err = d.CanAccessPeer(p); err != nil {
				return nil, err
			}
		}
		r.PeerAccess = append(r.PeerAccess, row)
	}
	return r, nil
}

// Run implements the command.
func (c *InfoCmd) Run(g *Globals) error {
	r, err := gatherInfo()
	if err != nil {
		if c.JSON {
			// Exit non-zero as well: the JSON is for scripts that read
			// stdout, the exit code for those that only check it.
			if perr := printJSON(g.stdout, &infoReport{Error: err.Error(), Devices: []deviceInfo{}, PeerAccess: [][]bool{}}); perr != nil {
				return perr
			}
		}
		return err
	}
	if c.JSON {
		return printJSON(g.stdout, r)
	}
	fmt.Fprintf(g.stdout, "driver: CUDA %s (%s), %d device(s)\n", r.DriverVersion, r.Library, len(r.Devices))
	tw := tabwriter.NewWriter(g.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "GPU\tUUID\tNAME\tMEMORY\tSM\tLEGACY IPC\tIPC EVENTS\tVMM FD\tPCI")
	for _, d := range r.Devices {
		fmt.Fprintf(tw, "%d\t%s\t%s\t%.1f GiB\t%s\t%s\t%s\t%s\t%s\n", d.Ordinal, d.UUID, d.Name,
			float64(d.MemoryBytes)/(1<<30), d.ComputeCapability, yesNo(d.LegacyIPC), yesNo(d.IPCEvents), yesNo(d.VMMFD), d.PCIBusID)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if len(r.Devices) > 1 {
		fmt.Fprintln(g.stdout, "\npeer access (row can map column):")
		tw = tabwriter.NewWriter(g.stdout, 0, 4, 2, ' ', 0)
		fmt.Fprint(tw, "\t")
		for j := range r.Devices {
			fmt.Fprintf(tw, "GPU%d\t", j)
		}
		fmt.Fprintln(tw)
		for i, row := range r.PeerAccess {
			fmt.Fprintf(tw, "GPU%d\t", i)
			for j, ok := range row {
				if i == j {
					fmt.Fprint(tw, "-\t")
				} else {
					fmt.Fprintf(tw, "%s\t", yesNo(ok))
				}
			}
			fmt.Fprintln(tw)
		}
		return tw.Flush()
	}
	return nil
}

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}
