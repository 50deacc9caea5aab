package cli

import (
	"fmt"
	"text/tabwriter"
	"time"

	"github.com/cudaipc/cudaipc/internal/bytesize"
)

type statCmd struct {
	Name string `arg:"" help:"Object to describe." placeholder:"NAME"`
	JSON bool   `name:"json" help:"Print one JSON object: name, size, device, sealed, leases, shared, owner_uid, created, region (GPU objects: cuda-ipc or vmm-fd; null for host objects), tensor (dtype, shape, strides; null when untyped)."`
}

func (c *statCmd) Run(g *Globals) error {
	cl, err := g.dial()
	if err != nil {
		return err
	}
	defer cl.Close()
	o, err := cl.Stat(g.Context(), c.Name)
	if err != nil {
		return explain(err, g.socketPath())
	}
	if c.JSON {
		return printJSON(g.stdout, o)
	}
	tw := tabwriter.NewWriter(g.stdout, 0, 0, 1, ' ', 0)
	fmt.Fprintf(tw, "name:\t%s\n", o.Name)
	fmt.Fprintf(tw, "size:\t%s (%d bytes)\n", bytesize.Format(o.Size), o.Size)
	fmt.Fprintf(tw, "device:\t%s\n", o.Device)
	fmt.Fprintf(tw, "sealed:\t%t\n", o.Sealed)
	fmt.Fprintf(tw, "leases:\t%d\n", o.Leases)
	fmt.Fprintf(tw, "shared:\t%t\n", o.Shared)
	if o.Sealed {
		fmt.Fprintf(tw, "creator can write:\t%t\n", o.CreatorCanWrite)
	}
	fmt.Fprintf(tw, "owner uid:\t%d\n", o.OwnerUID)
	fmt.Fprintf(tw, "created:\t%s\n", o.Created.Local().Format(time.RFC3339Nano))
	if t := o.Tensor; t != nil {
		fmt.Fprintf(tw, "tensor:\t%s %v", t.DType, t.Shape)
		if t.Strides != nil {
			fmt.Fprintf(tw, " strides %v", t.Strides)
		}
		fmt.Fprintln(tw)
	}
	if o.Region != nil {
		fmt.Fprintf(tw, "region:\t%s\n", o.Region)
	}
	return tw.Flush()
}
