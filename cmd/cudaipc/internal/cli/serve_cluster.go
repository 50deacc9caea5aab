package cli

import (
	"context"
	"errors"
	"fmt"
	"os"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/cudaipc/cudaipc/cluster"
	"github.com/cudaipc/cudaipc/cluster/etcddir"
	"github.com/cudaipc/cudaipc/cluster/node"
	"github.com/cudaipc/cudaipc/cluster/ucxtransport"
	"github.com/cudaipc/cudaipc/store"
	"github.com/cudaipc/cudaipc/transport/ucx"
)

// clusterFlags are the flags of the settings that join the daemon to a
// cluster of daemons (docs/cluster.md); without a cluster URL the daemon
// runs alone and none of this runs.
type clusterFlags struct {
	Cluster       *string `help:"Join a cluster of daemons whose directory is this etcd: etcd://HOST:PORT[,HOST:PORT...] (etcds:// for TLS). Needs --cluster-secret." placeholder:"URL" env:"CUDAIPC_CLUSTER"`
	Node          *string `help:"This daemon's name in the cluster (default: the host name)." placeholder:"NAME"`
	ClusterSecret *string `name:"cluster-secret" help:"File holding the cluster's shared secret (at least 16 bytes, mode 0600): daemons without it are refused." placeholder:"FILE" env:"CUDAIPC_CLUSTER_SECRET"`
	ClusterListen *string `name:"cluster-listen" help:"Address the cluster control channel listens on (default: the address it advertises, --cluster-advertise or else this host's address towards etcd with port 7946; :PORT for every interface)." placeholder:"HOST:PORT"`
	ClusterAdv    *string `name:"cluster-advertise" help:"HOST:PORT other daemons reach the control channel at (default: this host's address towards etcd)." placeholder:"HOST:PORT"`
	EtcdCA        *string `name:"etcd-ca" help:"CA certificate that signed etcd's (turns on TLS)." placeholder:"FILE"`
	EtcdCert      *string `name:"etcd-cert" help:"Client certificate for etcd (with --etcd-key)." placeholder:"FILE"`
	EtcdKey       *string `name:"etcd-key" help:"Client key for etcd." placeholder:"FILE"`
}

// apply overrides cfg with the flags given.
func (f *clusterFlags) apply(cfg *daemonConfig) {
	set(&cfg.Cluster, f.Cluster)
	set(&cfg.Node, f.Node)
	set(&cfg.ClusterSecret, f.ClusterSecret)
	set(&cfg.ClusterListen, f.ClusterListen)
	set(&cfg.ClusterAdv, f.ClusterAdv)
	set(&cfg.EtcdCA, f.EtcdCA)
	set(&cfg.EtcdCert, f.EtcdCert)
	set(&cfg.EtcdKey, f.EtcdKey)
}

// directoryConfig is the etcd directory configuration of cfg.
func directoryConfig(cfg *daemonConfig) (etcddir.Config, error) {
	var dc etcddir.Config
	eps, useTLS, err := etcddir.ParseURL(cfg.Cluster)
	if err != nil {
		return dc, fmt.Errorf("--cluster: %w", err)
	}
	if cfg.ClusterSecret == "" {
		return dc, errors.New("--cluster needs --cluster-secret FILE: daemons of a cluster authenticate each other with it (make one: head -c 32 /dev/urandom | base64 > FILE; chmod 600 FILE)")
	}
	sec, err := cluster.LoadSecret(cfg.ClusterSecret)
	if err != nil {
		return dc, fmt.Errorf("--cluster-secret: %w", err)
	}
	name := cfg.Node
	if name == "" {
		if name, err = os.Hostname(); err != nil {
			return dc, fmt.Errorf("--node: %w", err)
		}
	}
	if err := cluster.ValidateNodeName(name); err != nil {
		return dc, fmt.Errorf("--node: %w", err)
	}
	if useTLS && cfg.EtcdCA == "" && cfg.EtcdCert == "" {
		return dc, errors.New("etcds:// needs --etcd-ca (and --etcd-cert/--etcd-key for client certificates)")
	}
	return etcddir.Config{Endpoints: eps, Prefix: cfg.ClusterPrefix, Node: name, Secret: sec,
		CAFile: cfg.EtcdCA, CertFile: cfg.EtcdCert, KeyFile: cfg.EtcdKey}, nil
}

// startCluster starts the daemon's cluster node, or returns nil when cfg
// names no cluster.
func startCluster(ctx context.Context, g *Globals, cfg *daemonConfig) (*node.Node, error) {
	if cfg.Cluster == "" {
		if cfg.ClusterSecret != "" || cfg.Node != "" {
			return nil, errors.New("--node and --cluster-secret are for --cluster")
		}
		return nil, nil
	}
	dc, err := directoryConfig(cfg)
	if err != nil {
		return nil, err
	}
	if cfg.UCXLib != "" {
		if err := ucx.SetLibrary(cfg.UCXLib); err != nil {
			return nil, fmt.Errorf("ucx-lib: %w", err)
		}
	}
	streams := cfg.ClusterStreams
	if streams == 0 {
		// Four reads in flight on each connection to a holder (the
		// reads take the lanes in turn), and never fewer than one lane
		// needs (cluster.DefaultStreamsPerHolder).
		streams = max(cluster.DefaultStreamsPerHolder, 4*max(cfg.ClusterLanes, 1))
	}
	n, err := node.Start(ctx, node.Config{Directory: dc, Listen: cfg.ClusterListen, Advertise: cfg.ClusterAdv, Logger: g.log,
		StreamsPerHolder: streams, Lanes: cfg.ClusterLanes, Read: ucxtransport.ReadMode(cfg.ClusterRead),
		HostChecksums: cfg.ClusterChecksums == "host", ChunkSize: int64(cfg.ClusterChunk), StageFirst: cfg.ClusterGPUPublish == "staged"})
	if err != nil {
		return nil, fmt.Errorf("serve --cluster: %w", err)
	}
	return n, nil
}

// clusterRegistry is the store's metrics registry with the node's metrics
// in it; nil (the store's own) when the daemon runs alone.
func clusterRegistry(n *node.Node) prometheus.Registerer {
	if n == nil {
		return nil
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(n.Collectors()...)
	return reg
}

// clusterHook is the store's hook for n: nil (no interface holding a nil
// pointer) when the daemon runs alone.
func clusterHook(n *node.Node) store.ClusterHook {
	if n == nil {
		return nil
	}
	return n
}
