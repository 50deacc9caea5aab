package cli

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"sort"
	"text/tabwriter"
	"time"

	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/internal/bytesize"
)

type lsCmd struct {
	JSON  bool `name:"json" help:"Print a JSON array of objects (the fields of 'cudaipc stat --json'), or with --pools of KV block pools."`
	Pools bool `name:"pools" help:"List KV block pools only (their counts and bytes, not their blocks)."`

	lsClusterFlags `embed:""` // ls_cluster.go
}

func (c *lsCmd) Help() string {
	return "Lists the objects you may read: yours, and shared ones. Unsealed objects of other clients are not shown. " +
		"The KV block pools you may read follow the objects (docs/kv.md, \"Block pools\"): --pools lists them alone."
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
	var pools []client.PoolInfo
	if c.Pools || !c.JSON {
		if pools, err = cl.ListPools(g.Context()); err != nil && (c.Pools || !errors.Is(err, client.ErrInvalid)) {
			// A daemon that predates pools answers INVALID: it has none.
			return explain(err, g.socketPath())
		}
	}
	if c.Pools {
		if c.JSON {
			if pools == nil {
				pools = []client.PoolInfo{}
			}
			return printJSON(g.stdout, pools)
		}
		return printPools(g.stdout, pools)
	}
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
	if err := printTable(g.stdout, objs); err != nil || len(pools) == 0 {
		return err
	}
	fmt.Fprintln(g.stdout)
	return printPools(g.stdout, pools)
}

// printPools prints a table of KV block pools: their counts now and since
// they were made, not their blocks.
func printPools(w io.Writer, pools []client.PoolInfo) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "POOL\tBLOCKS\tBYTES\tCAPACITY\tBLOCK\tKEY\tDEVICE\tPINNED\tHITS\tMISSES\tEVICTIONS\tSHARED\tOWNER\tCLUSTER")
	for _, p := range pools {
		// A cluster-wide pool's counts are this node's share.
		fmt.Fprintf(tw, "%s\t%d/%d\t%s\t%s\t%s\t%d\t%s\t%d\t%d\t%d\t%d\t%t\t%d\t%t\n", p.Name, p.Blocks, p.CapacityBlocks,
			bytesize.Format(int64(p.Blocks)*p.BlockBytes), bytesize.Format(p.MemorySize), bytesize.Format(p.BlockBytes), p.KeyBytes,
			p.Device, p.Pinned, p.Hits, p.Misses, p.Evictions, p.Shared, p.OwnerUID, p.Cluster)
	}
	return tw.Flush()
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
