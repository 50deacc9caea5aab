package diag

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/cudaipc/cudaipc/cluster/etcddir"
)

// etcdCheck says whether the cluster directory the daemon would join
// (--cluster, or $CUDAIPC_CLUSTER as serve reads it) answers: each
// endpoint's etcd version and the live nodes under the prefix. Without a
// cluster it is skipped.
func etcdCheck(ctx context.Context, c *DoctorCmd) (name, status, detail string) {
	name = "etcd"
	if c.Cluster == "" {
		return name, "skip", "no --cluster (nor $CUDAIPC_CLUSTER): this daemon runs single-node"
	}
	eps, useTLS, err := etcddir.ParseURL(c.Cluster)
	if err != nil {
		return name, "fail", "--cluster: " + err.Error()
	}
	if useTLS && c.EtcdCA == "" && c.EtcdCert == "" {
		return name, "fail", "etcds:// needs --etcd-ca (and --etcd-cert/--etcd-key for client certificates)"
	}
	res, err := etcddir.Probe(ctx, etcddir.Config{Endpoints: eps, Prefix: c.ClusterPrefix,
		CAFile: c.EtcdCA, CertFile: c.EtcdCert, KeyFile: c.EtcdKey}, 3*time.Second)
	if err != nil {
		return name, "fail", err.Error()
	}
	var ok, bad []string
	for _, ep := range res.Endpoints {
		if ep.Err != nil {
			bad = append(bad, fmt.Sprintf("%s: %v", ep.Endpoint, ep.Err))
		} else {
			ok = append(ok, fmt.Sprintf("%s (etcd %s)", ep.Endpoint, ep.Version))
		}
	}
	switch {
	case len(ok) == 0:
		return name, "fail", "no etcd endpoint answered within 3s: " + strings.Join(bad, "; ")
	case len(bad) > 0:
		status = "warn"
	default:
		status = "ok"
	}
	detail = fmt.Sprintf("reached %s; %d live node(s) under %s", strings.Join(ok, ", "), res.Nodes, prefixOr(c.ClusterPrefix))
	if len(bad) > 0 {
		detail += "; not answering: " + strings.Join(bad, "; ")
	}
	return name, status, detail
}

func prefixOr(p string) string {
	if p == "" {
		return etcddir.DefaultPrefix
	}
	return p
}
