package diag

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/cudaipc/cudaipc/cluster"
	"github.com/cudaipc/cudaipc/cluster/etcddir"
)

// clusterRecords is the "cluster records" check's finding, in --json.
type clusterRecords struct {
	// Verified: the records were checked with the cluster secret; without
	// it only the keys were counted.
	Verified   bool `json:"verified"`
	NodeKeys   int  `json:"node_keys"`
	ObjectKeys int  `json:"object_keys"`
	// The audit's findings, with the secret.
	*etcddir.Audit
}

// etcdChecks say whether the cluster directory the daemon would join
// (--cluster, or $CUDAIPC_CLUSTER as serve reads it) answers, each
// endpoint with its etcd version ("etcd"), and what its records are
// ("cluster records"): with --cluster-secret each is checked with the
// secret, so that verified live nodes are told from records forged or
// written with another secret; without it only keys are counted, and the
// line says that proves nothing. Without a cluster both are skipped.
func etcdChecks(ctx context.Context, c *DoctorCmd) []check {
	if c.Cluster == "" {
		return []check{
			{Name: "etcd", Status: "skip", Detail: "no --cluster (nor $CUDAIPC_CLUSTER): this daemon runs single-node"},
		}
	}
	fail := func(detail string) []check { return []check{{Name: "etcd", Status: "fail", Detail: detail}} }
	eps, useTLS, err := etcddir.ParseURL(c.Cluster)
	if err != nil {
		return fail("--cluster: " + err.Error())
	}
	if useTLS && c.EtcdCA == "" && c.EtcdCert == "" {
		return fail("etcds:// needs --etcd-ca (and --etcd-cert/--etcd-key for client certificates)")
	}
	var sec cluster.Secret
	if c.ClusterSecret != "" {
		if sec, err = cluster.LoadSecret(c.ClusterSecret); err != nil {
			return fail("--cluster-secret: " + err.Error())
		}
	}
	res, err := etcddir.Probe(ctx, etcddir.Config{Endpoints: eps, Prefix: c.ClusterPrefix, Secret: sec,
		CAFile: c.EtcdCA, CertFile: c.EtcdCert, KeyFile: c.EtcdKey}, 3*time.Second)
	if err != nil && len(res.Endpoints) == 0 {
		return fail(err.Error())
	}
	var ok, bad []string
	for _, ep := range res.Endpoints {
		if ep.Err != nil {
			bad = append(bad, fmt.Sprintf("%s: %v", ep.Endpoint, ep.Err))
		} else {
			ok = append(ok, fmt.Sprintf("%s (etcd %s)", ep.Endpoint, ep.Version))
		}
	}
	if len(ok) == 0 {
		return fail("no etcd endpoint answered within 3s: " + strings.Join(bad, "; "))
	}
	conn := check{Name: "etcd", Status: "ok", Detail: "reached " + strings.Join(ok, ", ")}
	if len(bad) > 0 {
		conn.Status = "warn"
		conn.Detail += "; not answering: " + strings.Join(bad, "; ")
	}
	return []check{conn, recordsCheck(c, res, err)}
}

// recordsCheck is the "cluster records" line of a probe that reached etcd;
// err is the probe's failure to read the records, if any.
func recordsCheck(c *DoctorCmd, res etcddir.ProbeResult, err error) check {
	ch := check{Name: "cluster records", Cluster: &clusterRecords{NodeKeys: res.Nodes, ObjectKeys: res.Objects}}
	under := prefixOr(c.ClusterPrefix)
	switch {
	case err != nil:
		ch.Status, ch.Detail = "fail", err.Error()
		return ch
	case res.Audit == nil:
		ch.Status = "warn"
		ch.Detail = fmt.Sprintf("%d node key(s) and %d object key(s) under %s, not verified: without --cluster-secret FILE nothing tells a live node from a forged or wrong-secret record (a key proves nothing: whoever may write to etcd can write one)",
			res.Nodes, res.Objects, under)
		return ch
	}
	a := res.Audit
	ch.Cluster.Verified, ch.Cluster.Audit = true, a
	parts := []string{fmt.Sprintf("%d verified live node(s)", len(a.LiveNodes))}
	if len(a.LiveNodes) > 0 {
		parts[0] += " (" + strings.Join(a.LiveNodes, ", ") + ")"
	}
	parts = append(parts, fmt.Sprintf("%d object record(s) and %d other record(s) verify", a.Objects, a.Others))
	// Nodes first, then objects, then the rest in key order.
	byKind := map[string][]string{}
	kinds := []string{"node", "obj"}
	for _, b := range a.Bad {
		if byKind[b.Kind] == nil && !slices.Contains(kinds, b.Kind) {
			kinds = append(kinds, b.Kind)
		}
		byKind[b.Kind] = append(byKind[b.Kind], fmt.Sprintf("%s (%s)", b.Name, shortWhy(b.Why)))
	}
	for _, k := range kinds {
		if len(byKind[k]) == 0 {
			continue
		}
		parts = append(parts, fmt.Sprintf("%d %s record(s) do not verify: %s", len(byKind[k]), kindName(k), strings.Join(byKind[k], ", ")))
	}
	ch.Status, ch.Detail = "ok", "under "+under+": "+strings.Join(parts, "; ")
	if len(a.Bad) > 0 {
		ch.Status = "fail"
		ch.Detail += ": a node of this cluster with another secret needs this one (--cluster-secret); remove a forged key with 'etcdctl del KEY' ('cudaipc doctor --json' gives the keys), and keep etcd's write access to the cluster's daemons (docs/cluster.md)"
	}
	return ch
}

// shortWhy says the common reasons briefly.
func shortWhy(why string) string {
	if strings.HasPrefix(why, "MAC does not verify") {
		return "forged or another secret"
	}
	return why
}

// kindName names a key's kind for people.
func kindName(kind string) string {
	switch kind {
	case "obj":
		return "object"
	case "hold":
		return "holder"
	}
	return kind
}

func prefixOr(p string) string {
	if p == "" {
		return etcddir.DefaultPrefix
	}
	return p
}
