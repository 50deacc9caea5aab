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
	"github.com/cudaipc/cudaipc/internal/bytesize"
	"github.com/cudaipc/cudaipc/store"
	"github.com/cudaipc/cudaipc/transport/ucx"
)

// clusterFlags are what 'serve' needs to join a cluster of daemons
// (docs/cluster.md); without --cluster the daemon runs alone and none of
// this runs.
type clusterFlags struct {
	Cluster       string        `help:"Join a cluster of daemons whose directory is this etcd: etcd://HOST:PORT[,HOST:PORT...] (etcds:// for TLS). Needs --cluster-secret." placeholder:"URL" env:"CUDAIPC_CLUSTER"`
	Node          string        `help:"This daemon's name in the cluster (default: the host name)." placeholder:"NAME"`
	ClusterSecret string        `name:"cluster-secret" help:"File holding the cluster's shared secret (at least 16 bytes, mode 0600): daemons without it are refused." placeholder:"FILE" env:"CUDAIPC_CLUSTER_SECRET"`
	ClusterListen string        `name:"cluster-listen" help:"Address the cluster control channel listens on (default: the address it advertises, --cluster-advertise or else this host's address towards etcd with port 7946; :PORT for every interface)." placeholder:"HOST:PORT"`
	ClusterAdv    string        `name:"cluster-advertise" help:"HOST:PORT other daemons reach the control channel at (default: this host's address towards etcd)." placeholder:"HOST:PORT"`
	ClusterPrefix string        `name:"cluster-prefix" default:"/cudaipc/v1/" help:"etcd key prefix of the cluster (default ${default}; clusters sharing an etcd use different ones)." placeholder:"PREFIX"`
	EtcdCA        string        `name:"etcd-ca" help:"CA certificate that signed etcd's (turns on TLS)." placeholder:"FILE"`
	EtcdCert      string        `name:"etcd-cert" help:"Client certificate for etcd (with --etcd-key)." placeholder:"FILE"`
	EtcdKey       string        `name:"etcd-key" help:"Client key for etcd." placeholder:"FILE"`
	Streams       int           `name:"cluster-streams" default:"0" help:"Reads a pull keeps in flight from one holder (0: the default, four a lane and at least 8); more can fill a fast link whose round trip is long." placeholder:"N"`
	Lanes         int           `name:"cluster-lanes" default:"8" env:"CUDAIPC_CLUSTER_LANES" help:"UCX workers serving and pulling, each with its own progress thread and, between two daemons of several, its own connection (default ${default}; 0 or 1: one; at most 16). Over tcp one connection and one progress thread a side bound a pull well below what a fast link carries (docs/cluster.md). Daemons of versions before lanes cannot read from daemons of several." placeholder:"N"`
	Read          string        `name:"cluster-read" default:"fetch" enum:"fetch,get" env:"CUDAIPC_CLUSTER_READ" help:"How this daemon reads other daemons' memory: fetch (default: the holder sends an exposed object's bytes by UCX rendezvous and answers no GETs; a reader killed mid-read cannot bring the holder down) or get (UCX one-sided GETs, which tcp emulates; the daemon then answers GETs of any of its addresses from anyone who reaches its UCX port). A fetching daemon cannot read daemons of versions before fetches." placeholder:"MODE"`
	Checksums     string        `name:"cluster-checksums" default:"auto" enum:"auto,host" env:"CUDAIPC_CLUSTER_CHECKSUMS" help:"Where GPU objects' chunk checksums (CRC-32C, at the seal and on each chunk a pull lands) are computed: auto (default: on the object's GPU, by a small kernel of the daemon, where the driver runs it; else on the host) or host (the daemon's CPUs read every byte)." placeholder:"WHERE"`
	Chunk         bytesize.Size `name:"cluster-chunk" default:"0" env:"CUDAIPC_CLUSTER_CHUNK" help:"Chunk of the objects this daemon publishes: the unit a pull reads, checks and lands, a power of two from 64KiB to 1GiB (0: the default, 4MiB, doubled up to 16MiB for objects of more than 1024 chunks, further for objects of more than 65536). Larger chunks cost fewer reads per byte; a corrupted chunk is read again whole." placeholder:"BYTES"`
	GPUPublish    string        `name:"cluster-gpu-publish" default:"early" enum:"early,staged" env:"CUDAIPC_CLUSTER_GPU_PUBLISH" help:"When a GPU object's record goes out: early (default: once its GPU has the checksums, its copy to pinned host memory running behind, readers' fetches of bytes not copied yet waiting) or staged (after that copy: better where both daemons share one machine's memory bandwidth)." placeholder:"WHEN"`
	UCXLib        string        `name:"ucx-lib" help:"Use this libucp.so.0 (and the libucs, libuct, libucm beside it) instead of the system's, e.g. a UCX built with CUDA (HPC-X) to register GPU arenas directly; 'cudaipc doctor --ucx-lib PATH' checks it." placeholder:"PATH"`
}

// directoryConfig is the etcd directory configuration the flags give.
func (f *clusterFlags) directoryConfig() (etcddir.Config, error) {
	var cfg etcddir.Config
	eps, useTLS, err := etcddir.ParseURL(f.Cluster)
	if err != nil {
		return cfg, fmt.Errorf("--cluster: %w", err)
	}
	if f.ClusterSecret == "" {
		return cfg, errors.New("--cluster needs --cluster-secret FILE: daemons of a cluster authenticate each other with it (make one: head -c 32 /dev/urandom | base64 > FILE; chmod 600 FILE)")
	}
	sec, err := cluster.LoadSecret(f.ClusterSecret)
	if err != nil {
		return cfg, fmt.Errorf("--cluster-secret: %w", err)
	}
	name := f.Node
	if name == "" {
		if name, err = os.Hostname(); err != nil {
			return cfg, fmt.Errorf("--node: %w", err)
		}
	}
	if err := cluster.ValidateNodeName(name); err != nil {
		return cfg, fmt.Errorf("--node: %w", err)
	}
	if useTLS && f.EtcdCA == "" && f.EtcdCert == "" {
		return cfg, errors.New("etcds:// needs --etcd-ca (and --etcd-cert/--etcd-key for client certificates)")
	}
	return etcddir.Config{Endpoints: eps, Prefix: f.ClusterPrefix, Node: name, Secret: sec,
		CAFile: f.EtcdCA, CertFile: f.EtcdCert, KeyFile: f.EtcdKey}, nil
}

// startCluster starts the daemon's cluster node, or returns nil without
// --cluster.
func (f *clusterFlags) startCluster(ctx context.Context, g *Globals) (*node.Node, error) {
	if f.Cluster == "" {
		if f.ClusterSecret != "" || f.Node != "" {
			return nil, errors.New("--node and --cluster-secret are for --cluster")
		}
		return nil, nil
	}
	if f.Streams < 0 || f.Streams > 64 {
		return nil, fmt.Errorf("--cluster-streams %d: want 0 (the default) to 64", f.Streams)
	}
	if c := int64(f.Chunk); c != 0 && !cluster.ValidChunkSize(c) {
		return nil, fmt.Errorf("--cluster-chunk %s: want 0 (the default) or a power of two from 64KiB to 1GiB", f.Chunk)
	}
	if f.Lanes < 0 || f.Lanes > ucxtransport.MaxLanes {
		return nil, fmt.Errorf("--cluster-lanes %d: want 0 (one) to %d", f.Lanes, ucxtransport.MaxLanes)
	}
	dc, err := f.directoryConfig()
	if err != nil {
		return nil, err
	}
	if f.UCXLib != "" {
		if err := ucx.SetLibrary(f.UCXLib); err != nil {
			return nil, fmt.Errorf("--ucx-lib: %w", err)
		}
	}
	streams := f.Streams
	if streams == 0 {
		// Four reads in flight on each connection to a holder (the
		// reads take the lanes in turn), and never fewer than one lane
		// needs (cluster.DefaultStreamsPerHolder).
		streams = max(cluster.DefaultStreamsPerHolder, 4*max(f.Lanes, 1))
	}
	n, err := node.Start(ctx, node.Config{Directory: dc, Listen: f.ClusterListen, Advertise: f.ClusterAdv, Logger: g.log,
		StreamsPerHolder: streams, Lanes: f.Lanes, Read: ucxtransport.ReadMode(f.Read),
		HostChecksums: f.Checksums == "host", ChunkSize: int64(f.Chunk), StageFirst: f.GPUPublish == "staged"})
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
