package cli

import (
	"encoding/json"
	"fmt"
	"io"
	"sort"
	"text/tabwriter"
	"time"

	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/internal/bytesize"
)

type lsCmd struct {
	JSON bool `name:"json" help:"Print a JSON array of objects (the fields of 'cudaipc stat --json')."`

	lsClusterFlags `embed:""` // ls_cluster.go
}

func (c *lsCmd) Help() string {
	return "Lists the objects you may read: yours, and shared ones. Unsealed objects of other clients are not shown."
}

func (c *lsCmd) Run(g *Globals) error {
	if c.Cluster {
		return c.lsClusterFlags.list(g, c.JSON)
	}
	cl, err := g.dial()
	if err != nil {
		return err
	}
	defer cl.Close()
	objs, err := cl.List(g.Context())
	if err != nil {
		return explain(err, g.socketPath())
	}
	sort.Slice(objs, func(i, j int) bool { return objs[i].Name < objs[j].Name })
	if c.JSON {
		if objs == nil {
			objs = []client.ObjectInfo{} // [] rather than null
		}
		return printJSON(g.stdout, objs)
	}
	return printTable(g.stdout, objs)
}

func printTable(w io.Writer, objs []client.ObjectInfo) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "NAME\tSIZE\tDEVICE\tSTATE\tLEASES\tSHARED\tOWNER\tCREATED")
	for _, o := range objs {
		state := "sealed"
		if !o.Sealed {
			state = "writing"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%d\t%t\t%d\t%s\n", o.Name, bytesize.Format(o.Size), o.Device, state,
			o.Leases, o.Shared, o.OwnerUID, o.Created.Local().Format(time.DateTime))
	}
	return tw.Flush()
}

func printJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}
