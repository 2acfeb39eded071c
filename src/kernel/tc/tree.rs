//! The broadcast tree planner: which member forwards to which, for groups
//! larger than one table.

use std::net::SocketAddr;

use crate::wire::abi;

use super::{Result, TcPlane};

/// A node of a broadcast tree.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TreeNode {
    /// The sender: its table is the group's root table (port 0).
    Root,
    /// A member that forwards: its table is keyed by its own port.
    Member(SocketAddr),
}

/// What one node of a broadcast tree does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodePlan {
    /// The node.
    pub node: TreeNode,
    /// Depth: 0 for the root, 1 for its children, ...
    pub level: usize,
    /// Who it sends (root) or forwards (member) to: mask bit i = `children[i]`.
    pub children: Vec<SocketAddr>,
}

impl NodePlan {
    /// Port of this node's `bcast_groups` key: 0 for the root, the member's
    /// own port for a forwarding member.
    pub fn table_port(&self) -> u16 {
        match self.node {
            TreeNode::Root => abi::BCAST_PORT_ANY,
            TreeNode::Member(m) => m.port(),
        }
    }

    /// The AGB1 mask that reaches every child (what the root sends with).
    pub fn full_mask(&self) -> u32 {
        match self.children.len() {
            0 => 0,
            n if n >= 32 => u32::MAX,
            n => (1u32 << n) - 1,
        }
    }

    /// Write this node's table into `plane` (the plane of the node's host).
    pub fn apply(&self, plane: &TcPlane, group: u16) -> Result<()> {
        match self.node {
            TreeNode::Root => plane.set_group(group, &self.children),
            TreeNode::Member(m) => plane.set_forwarding(group, m.port(), &self.children),
        }
    }
}

/// Plan a broadcast tree over `members` (IPv4 or IPv6, one family: every
/// table is written with [`TcPlane::set_group`]'s rules) with at most
/// `fanout` children per node (clamped to 1..=32): the root sends to the
/// first `fanout` members,
/// member j forwards to members `fanout + j·fanout ..`, breadth first, so
/// the depth is the least possible, ⌈log_fanout⌉-ish. Returns the root's
/// plan first, then every member that has children, in member order.
/// Leaves need no table. The root sends with FORWARD set when the tree has
/// more than one level.
pub fn plan_tree<A: Into<SocketAddr> + Copy>(members: &[A], fanout: usize) -> Vec<NodePlan> {
    let members: Vec<SocketAddr> = members.iter().map(|&m| m.into()).collect();
    let fanout = fanout.clamp(1, abi::BCAST_MAX_DESTS as usize);
    let n = members.len();
    let mut plans = vec![NodePlan {
        node: TreeNode::Root,
        level: 0,
        children: members[..fanout.min(n)].to_vec(),
    }];
    // level of member j: root's children are level 1
    let mut level = vec![1usize; n];
    for j in 0..n {
        let start = fanout + j * fanout;
        if start >= n {
            break;
        }
        let end = (start + fanout).min(n);
        for k in start..end {
            level[k] = level[j] + 1;
        }
        plans.push(NodePlan {
            node: TreeNode::Member(members[j]),
            level: level[j],
            children: members[start..end].to_vec(),
        });
    }
    plans
}
