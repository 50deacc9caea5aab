package etcddir

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/client/pkg/v3/transport"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/cudaipc/cudaipc/cluster"
)

// EndpointStatus is what Probe learned of one etcd endpoint.
type EndpointStatus struct {
	Endpoint string
	// Version is the etcd server's version; Err why it did not answer.
	Version string
	Err     error
}

// ProbeResult is Probe's answer.
type ProbeResult struct {
	Endpoints []EndpointStatus
	// Nodes and Objects count the node and object keys under the prefix,
	// verified or not; -1 when etcd did not say.
	Nodes, Objects int
	// Audit is every record under the prefix checked with the cluster
	// secret; nil without one (Config.Secret), or when etcd did not answer.
	Audit *Audit
}

// Audit is what the cluster secret says of the records under a prefix. A
// key alone proves nothing: whoever may write to etcd can write one.
type Audit struct {
	// LiveNodes names the nodes whose records verify and live on a lease,
	// in key order.
	LiveNodes []string `json:"live_nodes"`
	// Objects counts the object records that verify; Others the other
	// records that do (holders, latest versions, pins, feeds).
	Objects int `json:"objects"`
	Others  int `json:"others"`
	// Bad lists, in key order, the records that do not verify, and node
	// records that verify but live on no lease (they never expire).
	Bad []BadRecord `json:"bad,omitempty"`
}

// BadRecord is a record an Audit refused.
type BadRecord struct {
	// Kind is the key's kind: "node", "obj", "hold", "latest", "pin",
	// "feed", or whatever segment follows the prefix.
	Kind string `json:"kind"`
	// Name is what the key names: a node, an object ("UID:NAME", with
	// "@vVERSION#SHARD" for a shard), an object on a node ("UID:NAME on
	// NODE", for holders and feeds), or the rest of the key.
	Name string `json:"name"`
	// Key is the whole etcd key, for etcdctl.
	Key string `json:"key"`
	// Why says what is wrong with it.
	Why string `json:"why"`
}

// auditPage is how many keys an Audit reads from etcd at a time.
const auditPage = 500

// Probe checks, for 'cudaipc doctor', that each endpoint of cfg answers
// (its version) within timeout and counts the node and object keys under
// cfg.Prefix; with cfg.Secret it also checks every record there with the
// secret (Audit), reading them in pages, each within timeout. Only
// Endpoints, Prefix, Secret and the TLS fields of cfg are used; nothing is
// written.
func Probe(ctx context.Context, cfg Config, timeout time.Duration) (ProbeResult, error) {
	res := ProbeResult{Nodes: -1, Objects: -1}
	if len(cfg.Endpoints) == 0 {
		return res, errors.New("etcd probe: no endpoints")
	}
	prefix := cfg.Prefix
	if prefix == "" {
		prefix = DefaultPrefix
	}
	if !strings.HasSuffix(prefix, "/") {
		prefix += "/"
	}
	tlsCfg := cfg.TLS
	if tlsCfg == nil && (cfg.CAFile != "" || cfg.CertFile != "" || cfg.KeyFile != "") {
		if (cfg.CertFile == "") != (cfg.KeyFile == "") {
			return res, errors.New("etcd TLS: give both the client certificate and its key, or neither")
		}
		info := transport.TLSInfo{CertFile: cfg.CertFile, KeyFile: cfg.KeyFile, TrustedCAFile: cfg.CAFile}
		c, err := info.ClientConfig()
		if err != nil {
			return res, fmt.Errorf("etcd TLS: %w", err)
		}
		tlsCfg = c
	}
	cli, err := clientv3.New(clientv3.Config{Endpoints: cfg.Endpoints, DialTimeout: timeout, TLS: tlsCfg, Logger: zap.NewNop()})
	if err != nil {
		return res, fmt.Errorf("etcd at %s: %w", strings.Join(cfg.Endpoints, ","), err)
	}
	defer cli.Close()
	answered := false
	for _, ep := range cfg.Endpoints {
		cctx, cancel := context.WithTimeout(ctx, timeout)
		st, err := cli.Status(cctx, ep)
		cancel()
		es := EndpointStatus{Endpoint: ep, Err: err}
		if err == nil {
			es.Version, answered = st.Version, true
		}
		res.Endpoints = append(res.Endpoints, es)
	}
	if !answered {
		return res, nil
	}
	k := keys{prefix}
	for _, c := range []struct {
		prefix string
		n      *int
	}{{k.nodes(), &res.Nodes}, {k.objects(), &res.Objects}} {
		cctx, cancel := context.WithTimeout(ctx, timeout)
		r, err := cli.Get(cctx, c.prefix, clientv3.WithPrefix(), clientv3.WithCountOnly())
		cancel()
		if err == nil {
			*c.n = int(r.Count)
		}
	}
	if !cfg.Secret.Valid() {
		return res, nil
	}
	a, err := audit(ctx, cli, cfg.Secret, k, timeout)
	if err != nil {
		return res, err
	}
	res.Audit = a
	return res, nil
}

// audit checks every record under k's prefix with sec.
func audit(ctx context.Context, cli *clientv3.Client, sec cluster.Secret, k keys, timeout time.Duration) (*Audit, error) {
	a := &Audit{LiveNodes: []string{}}
	end := clientv3.GetPrefixRangeEnd(k.p)
	for from := k.p; ; {
		cctx, cancel := context.WithTimeout(ctx, timeout)
		r, err := cli.Get(cctx, from, clientv3.WithRange(end), clientv3.WithLimit(auditPage))
		cancel()
		if err != nil {
			return nil, fmt.Errorf("etcd: read the records under %s: %w", k.p, err)
		}
		for _, kv := range r.Kvs {
			a.check(sec, k, kv)
		}
		if !r.More || len(r.Kvs) == 0 {
			return a, nil
		}
		from = string(r.Kvs[len(r.Kvs)-1].Key) + "\x00"
	}
}

// check verifies one record: a node's and an object's decoded in full,
// the others' MAC only (so that kinds this version does not know are
// checked too).
func (a *Audit) check(sec cluster.Secret, k keys, kv *mvccpb.KeyValue) {
	key := string(kv.Key)
	kind, rest, _ := strings.Cut(strings.TrimPrefix(key, k.p), "/")
	bad := BadRecord{Kind: kind, Name: rest, Key: key}
	var err error
	switch kind {
	case "node":
		var n cluster.Node
		switch err = cluster.Open(sec, key, kv.Value, &n); {
		case err != nil:
		case n.Name != rest:
			err = fmt.Errorf("the record names node %q", n.Name)
		case kv.Lease == 0:
			err = errors.New("verifies, but lives on no lease: it never expires, and no daemon wrote it so")
		default:
			a.LiveNodes = append(a.LiveNodes, n.Name)
			return
		}
	case "obj":
		if ref, _, perr := parseRef(rest); perr == nil {
			bad.Name = ref.String()
		}
		var o cluster.Object
		if err = cluster.Open(sec, key, kv.Value, &o); err == nil {
			a.Objects++
			return
		}
	default:
		if ref, node, perr := parseRef(rest); perr == nil && (kind == "hold" || kind == "feed") {
			bad.Name = ref.String() + " on " + node
		}
		if err = cluster.Verify(sec, key, kv.Value); err == nil {
			a.Others++
			return
		}
	}
	// The reason without the sentinel and the key, which bad names.
	why := err.Error()
	if _, after, ok := strings.Cut(why, key+": "); ok {
		why = after
	}
	bad.Why = why
	a.Bad = append(a.Bad, bad)
}
