package cli

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/cudaipc/cudaipc/cluster/etcddir"
	"github.com/cudaipc/cudaipc/internal/bytesize"
)

// lsClusterFlags make 'ls' list the cluster directory instead of the local
// store: names, versions and holders, read from etcd with the cluster
// secret (records that do not verify are left out).
type lsClusterFlags struct {
	Cluster       bool   `help:"List the cluster's names (every node's cluster-visible objects, their versions and holders) from etcd instead of the local store. Needs --etcd and --cluster-secret."`
	Etcd          string `help:"With --cluster: the cluster's etcd, etcd://HOST:PORT[,...] (as given to 'serve --cluster')." placeholder:"URL" env:"CUDAIPC_CLUSTER"`
	ClusterSecret string `name:"cluster-secret" help:"With --cluster: the cluster secret file, to verify the records." placeholder:"FILE" env:"CUDAIPC_CLUSTER_SECRET"`
	ClusterPrefix string `name:"cluster-prefix" default:"/cudaipc/v1/" help:"With --cluster: etcd key prefix of the cluster (default ${default})." placeholder:"PREFIX"`
	EtcdCA        string `name:"etcd-ca" help:"With --cluster: CA certificate that signed etcd's." placeholder:"FILE"`
	EtcdCert      string `name:"etcd-cert" help:"With --cluster: client certificate for etcd." placeholder:"FILE"`
	EtcdKey       string `name:"etcd-key" help:"With --cluster: client key for etcd." placeholder:"FILE"`
}

// clusterListing is one line of 'ls --cluster --json'.
type clusterListing struct {
	Name     string    `json:"name"`
	OwnerUID uint32    `json:"owner_uid"`
	Shared   bool      `json:"shared"`
	Size     int64     `json:"size"`
	Version  uint64    `json:"version,omitempty"`
	Shard    uint32    `json:"shard,omitempty"`
	Shards   uint32    `json:"shards,omitempty"`
	Latest   uint64    `json:"latest,omitempty"`
	Holders  []string  `json:"holders"`
	Origin   string    `json:"origin"`
	Sealed   time.Time `json:"sealed"`
	ID       string    `json:"id"`
	Checksum string    `json:"checksum"`
}

func (f *lsClusterFlags) list(g *Globals, asJSON bool) error {
	if f.Etcd == "" || f.ClusterSecret == "" {
		return errors.New("ls --cluster needs --etcd URL and --cluster-secret FILE (or $CUDAIPC_CLUSTER and $CUDAIPC_CLUSTER_SECRET)")
	}
	dc, err := directoryConfig(&daemonConfig{Cluster: f.Etcd, ClusterSecret: f.ClusterSecret, Node: "cudaipc-ls", ClusterPrefix: f.ClusterPrefix,
		EtcdCA: f.EtcdCA, EtcdCert: f.EtcdCert, EtcdKey: f.EtcdKey})
	if err != nil {
		return fmt.Errorf("ls --cluster (--etcd): %w", err)
	}
	dc.Logger = g.log
	ctx, cancel := context.WithTimeout(g.Context(), 10*time.Second)
	defer cancel()
	d, err := etcddir.Open(ctx, dc)
	if err != nil {
		return fmt.Errorf("ls --cluster: %w", err)
	}
	defer d.Close()
	ls, err := d.List(ctx)
	if err != nil {
		return fmt.Errorf("ls --cluster: %w", err)
	}
	out := make([]clusterListing, 0, len(ls))
	for _, l := range ls {
		holders := l.Holders
		if holders == nil {
			holders = []string{}
		}
		out = append(out, clusterListing{Name: l.Name, OwnerUID: l.Owner, Shared: l.Shared, Size: l.Size,
			Version: l.Version, Shard: l.Shard, Shards: l.Shards, Latest: l.Latest, Holders: holders,
			Origin: l.Origin, Sealed: l.Sealed, ID: l.ID, Checksum: fmt.Sprintf("crc32c/%d chunks of %s", len(l.Sums), bytesize.Format(l.ChunkSize))})
	}
	if asJSON {
		return printJSON(g.stdout, out)
	}
	tw := tabwriter.NewWriter(g.stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "NAME\tOWNER\tSIZE\tVERSION\tHOLDERS\tORIGIN\tSEALED")
	for _, l := range out {
		ver := "-"
		if l.Version != 0 {
			ver = fmt.Sprintf("%d (shard %d/%d)", l.Version, l.Shard, l.Shards)
			if l.Version == l.Latest {
				ver += " latest"
			}
		}
		holders := strings.Join(l.Holders, ",")
		if holders == "" {
			holders = "none live"
		}
		fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t%s\t%s\t%s\n", l.Name, l.OwnerUID, bytesize.Format(l.Size), ver, holders, l.Origin,
			l.Sealed.Local().Format(time.DateTime))
	}
	return tw.Flush()
}
